"""Hardware profiles for the performance model (`HardwareProfile`): H100 GTT/GTI (paper §4.1, App. A), H200 (spec),
CPU+gloo. Below the catalog of built-in profiles (`catalog.py`) and the loader by name or path (`hardware.py`).

A profile is per device (one GPU, or one CPU rank) plus the links between devices. Every number carries its
source in `sources`; `kind` says whether the profile is measured, fitted, from a spec sheet, or a rough estimate.
Profiles round-trip through JSON (`to_json` / `from_json`) so `cpinfer calibrate` can write measured ones; JSON
written before a field existed still loads (the field takes its documented default, `LEGACY` renames old keys).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from cpinfer.cp import cost_model
from cpinfer.utils import check_positive

KINDS = ("measured", "fitted", "spec", "estimate", "calibrated")

# Numeric fields, each with its unit; every one must have an entry in `sources`.
UNITS = {
    "peak_tflops": "TF/s dense peak of the compute dtype per device (bf16 on GPU, fp32 on CPU); GEMMs run at "
                   "peak_tflops * gemm_efficiency",
    "peak_tflops_fp8": "TF/s dense FP8 peak per device (0: no FP8 GEMMs, FP8 weights run at peak_tflops)",
    "attn_tflops": "TF/s achieved by the prefill attention kernel on a causal square of attn_ref_tokens (with the "
                   "L0 curve, the C of Alg. 1 / Alg. 5)",
    "attn_ref_tokens": "tokens of the causal square attn_tflops was measured on (paper: 8K)",
    "attn_overhead_tokens": "L0: fixed cost of one query row-tile, in keys' worth of work (short blocks run slower)",
    "gemm_efficiency": "achieved / peak of large GEMMs (0-1]",
    "mem_gb": "GB of device memory per device",
    "mem_tbps": "TB/s device memory bandwidth (peak)",
    "mem_efficiency": "achieved / peak memory bandwidth of streaming kernels (0-1]",
    "devices_per_node": "devices sharing the fast intra-node link",
    "intra_gbs": "GB/s achieved per-device bus bandwidth of intra-node collectives (all-reduce)",
    "intra_latency_us": "us fixed cost of one intra-node collective",
    "inter_gbs_peak": "GB/s line rate of one device's inter-node link (its NIC): what the concurrent flows of an "
                      "All2All share",
    "inter_gbs": "GB/s achieved by one SendRecv flow across nodes (the ring's; the BW of Alg. 1 / Alg. 5)",
    "inter_latency_us": "us fixed cost of one inter-node SendRecv / All2All",
    "inter_coll_gbs": "GB/s achieved per-device bus bandwidth of inter-node all-reduce (TP across nodes)",
    "ring_step_us": "us exposed per ring step (stream sync on the received block, per-step launches, merge)",
    "comm_overlap": "fraction of a step's compute time during which a ring transfer progresses (1: NIC DMA beside "
                    "the SMs; 0: the cores that compute also move the bytes, as gloo on CPU)",
    "kernel_overhead_us": "us per kernel under CUDA graphs (decode)",
}

# Fields added after profiles were first written: value when a JSON profile lacks them (its source says so).
DEFAULTS = {"attn_ref_tokens": 8192.0, "attn_overhead_tokens": 0.0, "inter_coll_gbs": None, "ring_step_us": 0.0,
            "comm_overlap": 1.0}
# Renamed keys: old name -> new name. `ring_step_floor_us` was measured as the time of a near-empty ring step,
# which is what `ring_step_us` adds to every step.
LEGACY = {"ring_step_floor_us": "ring_step_us"}
ZERO_OK = ("peak_tflops_fp8", "intra_latency_us", "inter_latency_us", "ring_step_us", "kernel_overhead_us",
           "attn_overhead_tokens", "comm_overlap")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str
    peak_tflops: float
    peak_tflops_fp8: float
    attn_tflops: float
    gemm_efficiency: float
    mem_gb: float
    mem_tbps: float
    mem_efficiency: float
    devices_per_node: int
    intra_gbs: float
    intra_latency_us: float
    inter_gbs_peak: float
    inter_gbs: float
    inter_latency_us: float
    kernel_overhead_us: float
    attn_ref_tokens: float = 8192.0
    attn_overhead_tokens: float = 0.0
    inter_coll_gbs: float | None = None   # None: the SendRecv rate inter_gbs
    ring_step_us: float = 0.0
    comm_overlap: float = 1.0
    empirical: tuple[float, float, float] | None = None  # App. D (alpha, beta, gamma) fitted on this system
    sources: dict = field(default_factory=dict, hash=False, compare=False)  # field name -> where it comes from

    def __post_init__(self) -> None:
        where = f"hardware profile {self.name!r}"
        if not self.name:
            raise ValueError("hardware profile: name must not be empty")
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        check_positive(self.devices_per_node, f"{where}: devices_per_node")
        if self.inter_coll_gbs is None:
            object.__setattr__(self, "inter_coll_gbs", self.inter_gbs)
            self.sources.setdefault("inter_coll_gbs", "default: the SendRecv rate inter_gbs")
        for name in UNITS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: {name} must be a number, got {value!r}")
            if value < 0 or (value == 0 and name not in ZERO_OK):
                raise ValueError(f"{where}: {name} ({UNITS[name]}) must be positive, got {value}")
            if name not in self.sources:
                raise ValueError(f"{where}: {name} has no source; say where the number comes from")
        for name in ("gemm_efficiency", "mem_efficiency", "comm_overlap"):
            if getattr(self, name) > 1:
                raise ValueError(f"{where}: {name} must be at most 1, got {getattr(self, name)}")
        if self.attn_tflops > self.peak_tflops:
            raise ValueError(f"{where}: attn_tflops ({self.attn_tflops}) exceeds peak_tflops ({self.peak_tflops})")
        if self.inter_gbs > self.inter_gbs_peak:
            raise ValueError(f"{where}: achieved inter_gbs ({self.inter_gbs}) exceeds inter_gbs_peak "
                             f"({self.inter_gbs_peak})")
        if self.empirical is not None:
            object.__setattr__(self, "empirical", _coeffs(self.empirical, where))

    # Derived rates in SI units.
    def gemm_flops_per_s(self, fp8: bool) -> float:
        peak = self.peak_tflops_fp8 if fp8 and self.peak_tflops_fp8 > 0 else self.peak_tflops
        return peak * 1e12 * self.gemm_efficiency

    def attn_flops_per_s(self) -> float:
        """A_inf, the long-block attention rate (cpinfer.cp.cost_model.attention_rate)."""
        return cost_model.attention_rate(self)

    @property
    def mem_bytes_per_s(self) -> float:
        return cost_model.memory_rate(self)

    def ring_link(self, cp: int, tp: int) -> cost_model.Link:
        """(bytes/s per flow, latency s, bytes/s shared by concurrent flows) of the slowest hop of a CP ring of cp
        ranks, each a TP group of tp devices."""
        return cost_model.ring_link(self, cp, tp)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["empirical"] = list(self.empirical) if self.empirical else None
        out["sources"] = dict(self.sources)
        return out

    def to_json(self, path: str | Path | None = None) -> str:
        """The profile as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict, origin: str = "a dict") -> HardwareProfile:
        data, sources = dict(data), dict(data.get("sources") or {})
        for old, new in LEGACY.items():  # migrate renamed keys of older profiles
            if old in data and new not in data:
                data[new] = data.pop(old)
                sources[new] = f"{sources.pop(old, 'from ' + origin)} (migrated from {old})"
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"hardware profile from {origin}: unknown keys {unknown}; known: {sorted(names)}")
        missing = sorted(n for n in names - set(data) if n not in ("empirical", "sources") and n not in DEFAULTS)
        if missing:
            raise ValueError(f"hardware profile from {origin}: missing keys {missing}")
        for name, default in DEFAULTS.items():
            if name not in data and default is not None:
                data[name] = default
                sources[name] = f"default {default}: {origin} predates this field"
        sources = {n: f"from {origin}" for n in UNITS} | sources
        return cls(**(data | {"sources": sources}))

    @classmethod
    def from_json(cls, text: str, origin: str = "JSON") -> HardwareProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"hardware profile from {origin}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"hardware profile from {origin}: expected a JSON object")
        return cls.from_dict(data, origin)


def _coeffs(value, where: str) -> tuple[float, float, float]:
    try:
        alpha, beta, gamma = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: empirical must be three numbers (alpha, beta, gamma), got {value!r}") from None
    return alpha, beta, gamma
