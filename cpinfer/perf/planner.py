"""Deployment planner: TTFT for pass-KV and pass-Q, the heuristic's choice, TTIT and memory for one setup.

`make_plan` runs the simulator for one (model, hardware, CP, TP, workload); `sweep_cp` finds the smallest CP
size that meets a TTFT target. Both are what `cpinfer plan` prints (docs/planning.md).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from fractions import Fraction

from cpinfer.cp.heuristics import StrategyChoice, choose_strategy
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.implementations import load_implementation
from cpinfer.perf.models import dtype_bytes, load_model_spec, load_weight_format
from cpinfer.perf.simulator import (STRATEGIES, Deployment, Estimate, Memory, memory_per_gpu, simulate_decode,
                                    simulate_prefill)
from cpinfer.utils import check_positive


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int       # T, new tokens per sequence
    cached_tokens: int = 0   # P, cached tokens per sequence
    batch: int = 1           # B identical sequences

    def __post_init__(self) -> None:
        check_positive(self.prompt_tokens, "prompt tokens")
        check_positive(self.batch, "batch")
        if isinstance(self.cached_tokens, bool) or not isinstance(self.cached_tokens, int) or self.cached_tokens < 0:
            raise ValueError(f"cached tokens must be a non-negative integer, got {self.cached_tokens!r}")

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.cached_tokens


@dataclass(frozen=True)
class Plan:
    deployment: Deployment
    workload: Workload
    ttft: dict               # strategy -> Estimate
    choice: StrategyChoice
    ttit: Estimate
    memory: Memory

    @property
    def chosen_ttft_s(self) -> float:
        return self.ttft[self.choice.strategy].seconds

    @property
    def warnings(self) -> tuple[str, ...]:
        """What makes this plan describe a deployment the model cannot run as configured."""
        m, ctx = self.deployment.model, self.workload.context_tokens
        out = []
        if m.max_context and ctx > m.max_context:
            out.append(f"{ctx} tokens exceed {m.name}'s max_position_embeddings ({m.max_context}); serving that "
                       f"needs RoPE scaling in its config")
        if not self.memory.fits:
            out.append("weights + KV do not fit in 90% of device memory")
        if m.linear_layers and self.deployment.tp > 1 and self.deployment.implementation.name == "cpinfer":
            out.append(f"cpinfer runs hybrid (linear-attention) models at tp 1 only (engine/hybrid.py); this plan "
                       f"prices the recurrent layers' heads split over tp {self.deployment.tp}")
        return tuple(out)

    @property
    def fastest(self) -> str:
        return min(STRATEGIES, key=lambda s: self.ttft[s].seconds)

    def to_dict(self) -> dict:
        d, w, m = self.deployment, self.workload, self.memory
        out = dict(model=d.model.name, hardware=d.hardware.name, hardware_kind=d.hardware.kind, cp=d.cp, tp=d.tp,
                   gpus=d.gpus, weights=d.weights.name, implementation=d.implementation.name,
                   prompt_tokens=w.prompt_tokens, cached_tokens=w.cached_tokens, batch=w.batch,
                   window=d.model.window, window_layers=d.model.window_layers, local_attention=d.model.local,
                   params=d.model.params, active_params=d.model.active_params, warnings=list(self.warnings))
        for s in STRATEGIES:
            e = self.ttft[s]
            out[s.replace("-", "_")] = dict(ttft_s=e.seconds, breakdown_s=dict(e.breakdown), **e.detail)
        out.update(choice=self.choice.strategy, choice_method=self.choice.method, choice_reason=self.choice.reason,
                   choice_inputs=self.choice.inputs, fastest_simulated=self.fastest, ttft_s=self.chosen_ttft_s,
                   ttit_s=self.ttit.seconds, ttit_breakdown_s=dict(self.ttit.breakdown), ttit_detail=self.ttit.detail,
                   memory_gb_per_gpu=m.total_gb, weights_gb_per_gpu=m.weights_gb, kv_gb_per_gpu=m.kv_gb,
                   capacity_gb_per_gpu=m.capacity_gb, fits=m.fits, state_gb_per_gpu=m.state_gb,
                   linear_layers=d.model.linear_layers, attention_layers=d.model.attn_layers)
        return out


def build_deployment(model, hardware, cp: int, tp: int, weights="bf16", act_dtype: str = "bf16",
                     kv_dtype: str = "bf16", implementation="cpinfer") -> Deployment:
    """Resolve catalog names / paths (or objects) into a validated Deployment."""
    return Deployment(load_model_spec(model), load_hardware_profile(hardware), cp, tp, load_weight_format(weights),
                      act_bytes=dtype_bytes(act_dtype), kv_bytes=dtype_bytes(kv_elem_dtype(kv_dtype)),
                      implementation=load_implementation(implementation), kv_scale_bytes=kv_scale_bytes(kv_dtype))


def kv_elem_dtype(kv_dtype: str) -> str:
    """The element dtype of a KV cache dtype: cpinfer's FP8 formats (fp8, fp8_e4m3, fp8_per_token) store fp8."""
    key = str(kv_dtype).strip().lower()
    return "fp8" if key in ("fp8_e4m3", "fp8_per_token") else key


def kv_scale_bytes(kv_dtype: str) -> int:
    """Scale bytes beside each K or V row's D values: 4 (one fp32 per token and KV head) in cpinfer's per-token FP8
    format; none in the static one (fp8 = fp8_e4m3: one scale per layer and KV head) or without FP8."""
    return 4 if str(kv_dtype).strip().lower() == "fp8_per_token" else 0


def choose(dep: Deployment, work: Workload, method: str = "alg5") -> StrategyChoice:
    """The pass-KV / pass-Q heuristic's pick for this deployment and workload (heads of one device, its ring)."""
    shape = dep.attn_shape
    return choose_strategy(work.batch * work.prompt_tokens, work.batch * work.cached_tokens, dep.cp,
                           n_heads=shape.heads, n_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                           elem_bytes=shape.elem_bytes, hardware=dep.hardware, method=method, tp=dep.tp,
                           partial_bytes=shape.partial_bytes)


def make_plan(dep: Deployment, work: Workload, method: str = "alg5") -> Plan:
    ttft = {s: simulate_prefill(dep, work.prompt_tokens, work.cached_tokens, work.batch, s) for s in STRATEGIES}
    choice = choose(dep, work, method)
    ttit = simulate_decode(dep, work.context_tokens, work.batch)
    memory = memory_per_gpu(dep, work.context_tokens, work.batch)
    return Plan(dep, work, ttft, choice, ttit, memory)


@dataclass(frozen=True)
class SweepRow:
    cp: int
    ttft_s: float            # TTFT of the heuristic's choice
    strategy: str
    memory_gb_per_gpu: float
    fits: bool


def sweep_cp(base: Deployment, work: Workload, target_s: float, max_cp: int = 64,
             method: str = "alg5") -> tuple[list[SweepRow], Plan | None]:
    """Try CP = 1..max_cp; return every row tried and the plan of the smallest CP that fits and meets target_s."""
    if not target_s > 0:
        raise ValueError(f"TTFT target must be positive seconds, got {target_s}")
    check_positive(max_cp, "max CP size")
    rows = []
    for cp in range(1, max_cp + 1):
        plan = make_plan(dataclasses.replace(base, cp=cp), work, method)
        rows.append(SweepRow(cp, plan.chosen_ttft_s, plan.choice.strategy, plan.memory.total_gb, plan.memory.fits))
        if plan.memory.fits and plan.chosen_ttft_s <= target_s:
            return rows, plan
    return rows, None


# vLLM's human-readable token counts: a lower-case suffix is decimal, an upper-case one binary
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")


def parse_token_count(text, what: str = "token count") -> int:
    """A token count as vLLM writes it: `131072`, `128k` (128,000), `128K` (131,072), `1m` (1,000,000), `1M`
    (1,048,576), `25.6k`; underscores and commas between digits are ignored. The result must be a whole number."""
    raw = str(text).strip().replace("_", "").replace(",", "")
    found = _COUNT.match(raw)
    if not found:
        raise ValueError(f"invalid {what} {text!r}: give a number, optionally with k / m / g (x1000) or "
                         "K / M / G (x1024), e.g. 128k or 1M")
    value = Fraction(found.group(1)) * _SUFFIXES[found.group(2)]
    if value.denominator != 1:
        raise ValueError(f"{what} {text!r} is {float(value):g}, not a whole number of tokens")
    return int(value)


@dataclass(frozen=True)
class Verdict:
    """Which constraint decided a plan (memory, the TTFT target, both, or none binding) and by how much."""
    decided_by: str          # "memory", "ttft", "both", "memory headroom" (no target), "ttft target not met", ...
    text: str
    memory_gb: float
    usable_gb: float
    ttft_s: float
    target_s: float | None

    def to_dict(self) -> dict:
        return dict(decided_by=self.decided_by, text=self.text, memory_gb_per_gpu=self.memory_gb,
                    usable_gb_per_gpu=self.usable_gb, memory_margin_gb=self.usable_gb - self.memory_gb,
                    ttft_s=self.ttft_s, ttft_target_s=self.target_s,
                    ttft_margin_s=None if self.target_s is None else self.target_s - self.ttft_s)


def _memory_words(used: float, usable: float) -> str:
    if used <= usable:
        return f"{used:.1f} GB per device of {usable:.1f} GB usable ({usable - used:.1f} GB, " \
               f"{(usable - used) / usable:.0%} free)"
    return f"{used:.1f} GB per device, {used - usable:.1f} GB over the {usable:.1f} GB usable"


def _ttft_words(ttft: float, target: float) -> str:
    side = "under" if ttft <= target else "over"
    return f"TTFT {ttft:.2f} s, {abs(target - ttft):.2f} s ({abs(target - ttft) / target:.0%}) {side} the " \
           f"{target:g} s target"


def plan_verdict(plan: Plan, target_s: float | None = None) -> Verdict:
    """For a plan at a given CP size: the tighter of memory and the TTFT target (relative margin), or what fails."""
    m, ttft = plan.memory, plan.chosen_ttft_s
    mem_slack = (m.usable_gb - m.total_gb) / m.usable_gb
    words = _memory_words(m.total_gb, m.usable_gb)
    if target_s is None:
        decided = "memory" if mem_slack < 0 else "memory headroom"
        return Verdict(decided, f"memory: {words}; no TTFT target given", m.total_gb, m.usable_gb, ttft, None)
    ttft_slack = (target_s - ttft) / target_s
    failing = [name for name, slack in (("memory", mem_slack), ("ttft", ttft_slack)) if slack < 0]
    if failing:
        decided = "both" if len(failing) == 2 else failing[0]
        lead = "does not fit and misses the TTFT target" if len(failing) == 2 else \
            "does not fit" if decided == "memory" else "misses the TTFT target"
    else:
        decided = "memory" if mem_slack < ttft_slack else "ttft"
        lead = f"the tighter constraint is {'memory' if decided == 'memory' else 'the TTFT target'}"
    text = f"{lead}: {_ttft_words(ttft, target_s)}; memory {words}"
    return Verdict(decided, text, m.total_gb, m.usable_gb, ttft, target_s)


def sweep_verdict(rows: list[SweepRow], plan: Plan | None, target_s: float, usable_gb: float,
                  weights_gb: float = 0.0) -> Verdict:
    """Why the sweep stopped where it did: what ruled out the CP size just below the smallest that works.
    `weights_gb`: the weights per device, which no CP size shrinks (CP shards the KV cache, TP the weights)."""
    last = rows[-1]
    if plan is None:
        text = f"no CP size up to {last.cp} works: at CP{last.cp} {_ttft_words(last.ttft_s, target_s)}; memory " \
               f"{_memory_words(last.memory_gb_per_gpu, usable_gb)}"
        if weights_gb > usable_gb:
            text += f"; the weights alone take {weights_gb:.1f} GB per device, which CP does not shard: raise " \
                    "--tp or use devices with more memory"
        decided = "ttft" if last.fits else "memory" if last.ttft_s <= target_s else "both"
        return Verdict(decided, text, last.memory_gb_per_gpu, usable_gb, last.ttft_s, target_s)
    here = f"at CP{last.cp}: {_ttft_words(last.ttft_s, target_s)}; memory " \
           f"{_memory_words(last.memory_gb_per_gpu, usable_gb)}"
    if len(rows) == 1:
        return Verdict("none", f"CP1 already meets both; {here}", last.memory_gb_per_gpu, usable_gb, last.ttft_s,
                       target_s)
    prev = rows[-2]
    mem, fast = prev.fits, prev.ttft_s <= target_s
    decided = "ttft" if mem else "memory" if fast else "both"
    why = {"ttft": f"the TTFT target: CP{prev.cp} fits but its {_ttft_words(prev.ttft_s, target_s)}",
           "memory": f"memory: CP{prev.cp} meets the TTFT target ({prev.ttft_s:.2f} s) but needs "
                     f"{_memory_words(prev.memory_gb_per_gpu, usable_gb)}",
           "both": f"memory and the TTFT target: CP{prev.cp} needs "
                   f"{_memory_words(prev.memory_gb_per_gpu, usable_gb)} and its {_ttft_words(prev.ttft_s, target_s)}"}
    return Verdict(decided, f"{why[decided]}; {here}", last.memory_gb_per_gpu, usable_gb, last.ttft_s,
                   target_s)
