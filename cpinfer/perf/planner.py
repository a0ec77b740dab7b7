"""Deployment planner: TTFT for pass-KV and pass-Q, the heuristic's choice, TTIT and memory for one setup.

`make_plan` runs the simulator for one (model, hardware, CP, TP, workload); `sweep_cp` finds the smallest CP
size that meets a TTFT target. Both are what `cpinfer plan` prints (docs/planning.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
                   capacity_gb_per_gpu=m.capacity_gb, fits=m.fits)
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
