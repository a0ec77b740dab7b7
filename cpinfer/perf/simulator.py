"""Simulated forward pass on CP x TP: TTFT (full / partial prefill, pass-KV or pass-Q), TTIT, memory per GPU.

Per layer: TP-sharded GEMMs, memory-bound elementwise ops, two TP all-reduces, and ring attention whose
N steps each take max(attention, SendRecv, host floor) -- the ring overlaps the transfer with the step's
attention (paper §3.4, §3.5), so exposed SendRecv = max(0, comm - compute) per step. Pass-Q adds its All2All
(App. C), fully exposed. Decode uses batched ring pass-Q with the batch padded to a multiple of N (§3.6, §4.3).
Fitted parameters live in the hardware profile; on h100-gtt four are fitted to public numbers of the paper
(cpinfer/perf/fit.py): gemm_efficiency 0.436 (CP8 128K TTFT 5.85 s), ring_step_floor_us 902 (CP16 128K 3.8 s),
inter_gbs 11.3 (pass-KV = pass-Q at T=6400 on CP4), inter_latency_us 61 (CP4 TTIT 71 ms). See docs/planning.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from cpinfer.perf import costs
from cpinfer.perf.costs import AttnShape
from cpinfer.perf.hardware import HardwareProfile
from cpinfer.perf.models import ModelSpec, WeightFormat
from cpinfer.perf.ring import RingShape
from cpinfer.utils import ceil_div, check_positive

STRATEGIES = ("pass-kv", "pass-q")
ELEMENTWISE_HIDDEN_PASSES = 10   # 2 RMSNorms (read+write) + 2 residual adds (2 reads + write), per token
ELEMENTWISE_FFN_PASSES = 3       # SwiGLU: read gate and up, write the product
DECODE_KERNELS_PER_LAYER = 13    # norms, RoPE, KV append, residuals, activation, 4 GEMMs, 2 all-reduces


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    hardware: HardwareProfile
    cp: int                  # N, CP ranks (nodes in the paper's setup)
    tp: int                  # N_TP, GPUs per CP rank
    weights: WeightFormat
    act_bytes: int = 2       # e, activations and the Q/K/V messages
    kv_bytes: int = 2        # KV cache element size

    def __post_init__(self) -> None:
        check_positive(self.cp, "cp")
        check_positive(self.tp, "tp")
        self.model.kv_heads_per_gpu(self.tp)  # validates tp against the head counts

    @property
    def gpus(self) -> int:
        return self.cp * self.tp

    @property
    def attn_shape(self) -> AttnShape:
        m = self.model
        return AttnShape(m.n_heads // self.tp, m.kv_heads_per_gpu(self.tp), m.head_dim, self.act_bytes)

    @property
    def link(self) -> tuple[float, float]:
        return self.hardware.ring_link(self.cp, self.tp)


@dataclass(frozen=True)
class Estimate:
    """A predicted latency; `breakdown` sums to `seconds` (all in seconds, whole forward pass)."""
    strategy: str
    seconds: float
    breakdown: dict
    detail: dict             # per-step and per-layer numbers worth showing


def ring_attention_layer(hw: HardwareProfile, shape: AttnShape, ring: RingShape, batch: int, strategy: str,
                         link: tuple[float, float]) -> dict:
    """One layer of ring attention on one rank, seconds by component (eager prefill)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    n, lq = ring.n, batch * ring.q_tokens
    if strategy == "pass-kv":
        msg = shape.kv_bytes(batch * ring.max_kv_tokens)
    else:
        msg = shape.q_bytes(lq)
    comm = costs.p2p_time(msg, link) if n > 1 else 0.0
    floor = hw.ring_step_floor_us * 1e-6
    out = dict(attention=0.0, sendrecv_exposed=0.0, overhead=0.0, step_attention_max=0.0)
    for j in range(n):
        compute = max(_step_compute(hw, shape, ring, batch, strategy, k, (k - j) % n) for k in range(n))
        c = comm if j < n - 1 else 0.0
        out["attention"] += compute
        out["sendrecv_exposed"] += max(0.0, c - compute)
        out["overhead"] += max(0.0, floor - max(compute, c))
        out["step_attention_max"] = max(out["step_attention_max"], compute)
    out["merge"] = costs.merge_time(hw, shape, lq, n)
    out["all2all"] = costs.all2all_time(shape.partial_out_bytes(lq), n, link) if strategy == "pass-q" else 0.0
    out["step_sendrecv"], out["message_bytes"] = comm, msg if n > 1 else 0
    return out


def _step_compute(hw, shape, ring, batch, strategy, rank, other) -> float:
    """Attention time on `rank` at a step where it meets `other` (KV source for pass-KV, Q source for pass-Q)."""
    q_rank, kv_rank = (rank, other) if strategy == "pass-kv" else (other, rank)
    pairs = batch * ring.visible_pairs(q_rank, kv_rank)
    return costs.attention_time(hw, shape, pairs, batch * ring.q_tokens, batch * ring.kv_tokens(kv_rank))


def _dense_layer(dep: Deployment, tokens: int) -> dict:
    """GEMMs, elementwise ops and the two TP all-reduces of one layer on one GPU for `tokens` tokens."""
    m, w, hw, tp = dep.model, dep.weights, dep.hardware, dep.tp
    attn_w = m.attn_params * w.attn_bytes / tp
    gemm = costs.gemm_time(hw, 2 * tokens * m.attn_params / tp, attn_w, w.attn_fp8) + \
        costs.gemm_time(hw, 2 * tokens * m.ffn_params / tp, m.ffn_params * w.ffn_bytes / tp, w.ffn_fp8)
    passes = ELEMENTWISE_HIDDEN_PASSES * m.hidden + ELEMENTWISE_FFN_PASSES * m.ffn_dim / tp
    if w.ffn_fp8:  # dynamic row-wise quantization of the two FFN GEMM inputs: read + 1-byte write
        passes += 1.5 * (m.hidden + m.ffn_dim / tp)
    elementwise = tokens * passes * dep.act_bytes / hw.mem_bytes_per_s
    allreduce = 2 * costs.allreduce_time(hw, tokens * m.hidden * dep.act_bytes, tp)
    return dict(gemm=gemm, elementwise=elementwise, allreduce=allreduce)


def _lm_head(dep: Deployment, tokens: int) -> float:
    m = dep.model
    return costs.gemm_time(dep.hardware, 2 * tokens * m.vocab * m.hidden / dep.tp,
                           m.vocab * m.hidden * dep.weights.embed_bytes / dep.tp, False)


def simulate_prefill(dep: Deployment, prompt_tokens: int, cached_tokens: int = 0, batch: int = 1,
                     strategy: str = "pass-kv") -> Estimate:
    """TTFT of B identical sequences, each with T new and P cached tokens, on dep.cp x dep.tp GPUs."""
    check_positive(batch, "batch")
    ring = RingShape(dep.cp, prompt_tokens, cached_tokens)
    attn = ring_attention_layer(dep.hardware, dep.attn_shape, ring, batch, strategy, dep.link)
    dense = _dense_layer(dep, batch * ring.q_tokens)
    keys = ("gemm", "attention", "merge", "sendrecv_exposed", "all2all", "allreduce", "elementwise", "overhead")
    per_layer = {k: dense.get(k, attn.get(k, 0.0)) for k in keys}
    breakdown = {k: v * dep.model.n_layers for k, v in per_layer.items()}
    breakdown["gemm"] += _lm_head(dep, batch)
    seconds = sum(breakdown.values())
    flops = paper_flops(dep.model, prompt_tokens, cached_tokens, batch)
    detail = dict(chunk_tokens=ring.chunk, padding_tokens=batch * ring.padding,
                  tokens_per_rank=batch * ring.q_tokens, ring_message_mb=attn["message_bytes"] / 1e6,
                  step_sendrecv_us=attn["step_sendrecv"] * 1e6,
                  step_attention_max_us=attn["step_attention_max"] * 1e6,
                  tflops_per_gpu=flops / seconds / dep.gpus / 1e12)
    return Estimate(strategy, seconds, breakdown, detail)


def simulate_decode(dep: Deployment, context_tokens: int, batch: int = 1) -> Estimate:
    """TTIT: one decode step of `batch` sequences with `context_tokens` cached each (ring pass-Q decode).

    The batch is padded to a multiple of N (one query per rank at batch 1); CUDA graphs, so no host floor.
    """
    check_positive(context_tokens, "context tokens")
    check_positive(batch, "batch")
    hw, shape, n = dep.hardware, dep.attn_shape, dep.cp
    q = ceil_div(batch, n)                     # queries per rank after padding
    kv = q * ceil_div(context_tokens, n)       # keys read per step: each query's local shard
    compute = costs.attention_time(hw, shape, kv, q, kv) + hw.kernel_overhead_us * 1e-6
    comm = costs.p2p_time(shape.q_bytes(q), dep.link) if n > 1 else 0.0
    steps = [max(compute, comm if j < n - 1 else 0.0) for j in range(n)]
    per_layer = _dense_layer(dep, q)
    per_layer["attention"] = n * compute
    per_layer["sendrecv_exposed"] = sum(steps) - n * compute
    per_layer["merge"] = costs.merge_time(hw, shape, q, n)
    per_layer["all2all"] = costs.all2all_time(shape.partial_out_bytes(q), n, dep.link)
    per_layer["overhead"] = DECODE_KERNELS_PER_LAYER * hw.kernel_overhead_us * 1e-6
    breakdown = {k: v * dep.model.n_layers for k, v in per_layer.items()}
    breakdown["gemm"] += _lm_head(dep, q)
    detail = dict(queries_per_rank=q, padded_batch=q * n, padding_queries=q * n - batch)
    return Estimate("pass-q" if n > 1 else "local", sum(breakdown.values()), breakdown, detail)


@dataclass(frozen=True)
class Memory:
    weights_gb: float
    kv_gb: float
    capacity_gb: float

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.kv_gb

    @property
    def fits(self) -> bool:
        """Weights + KV within 90% of device memory (the rest for activations and workspace)."""
        return self.total_gb <= 0.9 * self.capacity_gb


def memory_per_gpu(dep: Deployment, tokens_per_seq: int, batch: int = 1) -> Memory:
    """Weights (TP-sharded) and the KV cache of `batch` sequences of `tokens_per_seq` (CP-sharded)."""
    weights = dep.weights.weight_bytes_per_gpu(dep.model, dep.tp)
    kv_tokens = batch * 2 * dep.cp * ceil_div(tokens_per_seq, 2 * dep.cp) / dep.cp
    kv = kv_tokens * dep.model.kv_bytes_per_token(dep.tp, dep.kv_bytes)
    return Memory(weights / 1e9, kv / 1e9, dep.hardware.mem_gb)


def paper_flops(model: ModelSpec, new: int, cached: int = 0, batch: int = 1) -> float:
    """App. A: 2*W*T*B GEMM FLOPs + 4*B*T*(T/2 + P)*D*layers attention FLOPs (causal half for new tokens)."""
    d = model.n_heads * model.head_dim
    return 2.0 * model.params * new * batch + 4.0 * batch * new * (new / 2 + cached) * d * model.n_layers
