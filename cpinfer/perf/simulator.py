"""Simulated forward pass on CP x TP: TTFT (full / partial prefill, pass-KV or pass-Q), TTIT, memory per GPU.

Per layer on one GPU (paper §3.4, §3.5, §4.1, §4.3): the TP-sharded GEMMs (FP8 FFN, bf16 projections), memory-bound
elementwise ops, two TP all-reduces, and ring attention: N steps, each taking the slowest rank's attention block
or the SendRecv it overlaps, whichever is longer, plus the per-step cost of an eager ring; pass-Q adds its All2All
(App. C). Decode is batched ring pass-Q under CUDA graphs with the batch padded to a multiple of N (§3.6, §4.3).
Every hardware number comes from the profile; `cpinfer/perf/fit.py` says which are fitted and to what.
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
# Memory passes over one token's hidden vector per layer: two fused residual-add + RMSNorm kernels (read x and
# residual, write both and the normed x: 5 each), on the 1/TP token slice each rank norms (sequence-parallel TP).
ELEMENTWISE_HIDDEN_PASSES = 10
ELEMENTWISE_FFN_PASSES = 3       # SwiGLU on the TP shard of the FFN: read gate and up, write the product
DECODE_KERNELS_PER_LAYER = 9     # 2 norms, RoPE, KV append, 2 residuals, SwiGLU, 2 FP8 quantizations
DECODE_KERNELS_PER_RING_STEP = 2  # besides flash-decoding's two: the grouped NCCL send/recv, the Q-buffer swap
DECODE_KERNELS_AFTER_RING = 3     # permute, All2All, merge (Alg. 4)
COMPONENTS = ("gemm", "attention", "merge", "sendrecv_exposed", "ring_steps", "all2all", "allreduce",
              "elementwise", "kernels")


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
    """A predicted latency; `breakdown` (seconds per COMPONENTS key, whole forward pass) sums to `seconds`."""
    strategy: str
    seconds: float
    breakdown: dict
    detail: dict             # per-step and per-layer numbers worth showing


def ring_attention_layer(hw: HardwareProfile, shape: AttnShape, ring: RingShape, batch: int, strategy: str,
                         link: tuple[float, float]) -> dict:
    """One layer of ring attention on one rank (eager prefill), seconds by component.

    Step j: every rank computes its block while the next block travels; the step ends when the slowest rank's
    block and the transfer are both done, plus ring_step_us. The transfer progresses during comm_overlap of the
    compute time, so exposed SendRecv = max(0, comm - comm_overlap * compute) per step (comm - compute on a GPU).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    n, lq = ring.n, batch * ring.q_tokens
    msg = shape.kv_bytes(batch * ring.max_kv_tokens) if strategy == "pass-kv" else shape.q_bytes(lq)
    comm = costs.p2p_time(msg, link) if n > 1 else 0.0
    out = dict(attention=0.0, sendrecv_exposed=0.0, step_attention_max=0.0)
    for j in range(n):
        compute = max(_step_compute(hw, shape, ring, batch, strategy, k, (k - j) % n) for k in range(n))
        out["attention"] += compute
        out["sendrecv_exposed"] += max(0.0, (comm if j < n - 1 else 0.0) - hw.comm_overlap * compute)
        out["step_attention_max"] = max(out["step_attention_max"], compute)
    out["ring_steps"] = n * hw.ring_step_us * 1e-6 if n > 1 else 0.0
    out["merge"] = costs.merge_time(hw, shape, lq, n)
    out["all2all"] = costs.all2all_time(shape.partial_out_bytes(lq), n, link) if strategy == "pass-q" else 0.0
    out["step_sendrecv"], out["message_bytes"] = comm, (msg if n > 1 else 0)
    return out


def _step_compute(hw, shape, ring, batch, strategy, rank, other) -> float:
    """Attention time on `rank` at a step where it meets `other` (KV source for pass-KV, Q source for pass-Q)."""
    q_rank, kv_rank = (rank, other) if strategy == "pass-kv" else (other, rank)
    pairs = batch * ring.visible_pairs(q_rank, kv_rank)
    return costs.attention_time(hw, shape, pairs, batch * ring.q_tokens, batch * ring.kv_tokens(kv_rank))


def gemm_layer(dep: Deployment, tokens: int) -> float:
    """The four GEMM groups of one layer on one TP rank for `tokens` rows (Megatron column/row sharding)."""
    m, w, hw, tp = dep.model, dep.weights, dep.hardware, dep.tp
    shape = dep.attn_shape
    qkv_n = (shape.heads + 2 * shape.kv_heads) * m.head_dim      # KV heads replicated when tp > N_KV
    o_k, ffn = shape.heads * m.head_dim, m.ffn_dim // tp
    t = costs.gemm_time(hw, tokens, qkv_n, m.hidden, qkv_n * m.hidden * w.attn_bytes, w.attn_fp8)
    t += costs.gemm_time(hw, tokens, m.hidden, o_k, o_k * m.hidden * w.attn_bytes, w.attn_fp8)
    t += costs.gemm_time(hw, tokens, 2 * ffn, m.hidden, 2 * ffn * m.hidden * w.ffn_bytes, w.ffn_fp8)
    t += costs.gemm_time(hw, tokens, m.hidden, ffn, ffn * m.hidden * w.ffn_bytes, w.ffn_fp8)
    return t


def _dense_layer(dep: Deployment, tokens: int) -> dict:
    """GEMMs, elementwise ops and the two TP all-reduces of one layer on one GPU for `tokens` tokens."""
    m, w, hw, tp = dep.model, dep.weights, dep.hardware, dep.tp
    passes = (ELEMENTWISE_HIDDEN_PASSES * m.hidden + ELEMENTWISE_FFN_PASSES * m.ffn_dim) / tp
    if w.ffn_fp8:  # dynamic row-wise quantization of the two FFN GEMM inputs: read + 1-byte write
        passes += 1.5 * (m.hidden + m.ffn_dim / tp)
    elementwise = tokens * passes * dep.act_bytes / hw.mem_bytes_per_s
    allreduce = 2 * costs.allreduce_time(hw, tokens * m.hidden * dep.act_bytes, tp)  # = RS + AG, same bytes
    return dict(gemm=gemm_layer(dep, tokens), elementwise=elementwise, allreduce=allreduce)


def _lm_head(dep: Deployment, tokens: int) -> float:
    m = dep.model
    n = ceil_div(m.vocab, dep.tp)
    return costs.gemm_time(dep.hardware, tokens, n, m.hidden, n * m.hidden * dep.weights.embed_bytes, False)


def simulate_prefill(dep: Deployment, prompt_tokens: int, cached_tokens: int = 0, batch: int = 1,
                     strategy: str = "pass-kv") -> Estimate:
    """TTFT of B identical sequences, each with T new and P cached tokens, on dep.cp x dep.tp GPUs."""
    check_positive(batch, "batch")
    ring = RingShape(dep.cp, prompt_tokens, cached_tokens)
    attn = ring_attention_layer(dep.hardware, dep.attn_shape, ring, batch, strategy, dep.link)
    per_layer = _dense_layer(dep, batch * ring.q_tokens) | {k: attn[k] for k in
                                                             ("attention", "merge", "sendrecv_exposed",
                                                              "ring_steps", "all2all")}
    breakdown = {k: per_layer.get(k, 0.0) * dep.model.n_layers for k in COMPONENTS}
    breakdown["gemm"] += _lm_head(dep, batch)
    seconds = sum(breakdown.values())
    flops = paper_flops(dep.model, prompt_tokens, cached_tokens, batch)
    detail = dict(chunk_tokens=ring.chunk, padding_tokens=batch * ring.padding,
                  tokens_per_rank=batch * ring.q_tokens, ring_message_mb=attn["message_bytes"] / 1e6,
                  step_sendrecv_us=attn["step_sendrecv"] * 1e6,
                  step_attention_max_us=attn["step_attention_max"] * 1e6,
                  tflops_per_gpu=flops / seconds / dep.gpus / 1e12)
    return Estimate(strategy, seconds, breakdown, detail)


def decode_attention_layer(dep: Deployment, context_tokens: int, batch: int) -> dict:
    """Batched ring pass-Q decode attention of one layer (Alg. 4), seconds by component, under CUDA graphs.

    The batch is padded to a multiple of N (§4.3), so each rank holds q = ceil(B/N) queries; every step runs
    flash-decoding of q queries over this rank's ~context/N keys while the next Q block travels.
    """
    hw, shape, n = dep.hardware, dep.attn_shape, dep.cp
    q = ceil_div(batch, n)
    op = costs.decode_attention_time(hw, shape, q, ceil_div(context_tokens, n))
    comm = costs.p2p_time(shape.q_bytes(q), dep.link) if n > 1 else 0.0
    exposed = (n - 1) * max(0.0, comm - hw.comm_overlap * op)
    return dict(attention=n * op, sendrecv_exposed=exposed, merge=costs.merge_time(hw, shape, q, n),
                all2all=costs.all2all_time(shape.partial_out_bytes(q), n, dep.link), op=op, queries=q)


def simulate_decode(dep: Deployment, context_tokens: int, batch: int = 1) -> Estimate:
    """TTIT: one decode step of `batch` sequences with `context_tokens` cached each (ring pass-Q decode)."""
    check_positive(context_tokens, "context tokens")
    check_positive(batch, "batch")
    att = decode_attention_layer(dep, context_tokens, batch)
    q = att["queries"]
    per_layer = _dense_layer(dep, q) | {k: att[k] for k in ("attention", "sendrecv_exposed", "merge", "all2all")}
    ring_kernels = DECODE_KERNELS_PER_RING_STEP * dep.cp + DECODE_KERNELS_AFTER_RING if dep.cp > 1 else 0
    per_layer["kernels"] = (DECODE_KERNELS_PER_LAYER + ring_kernels) * dep.hardware.kernel_overhead_us * 1e-6
    breakdown = {k: per_layer.get(k, 0.0) * dep.model.n_layers for k in COMPONENTS}
    breakdown["gemm"] += _lm_head(dep, q)
    detail = dict(queries_per_rank=q, padded_batch=q * dep.cp, padding_queries=q * dep.cp - batch,
                  attention_op_us=att["op"] * 1e6)
    return Estimate("pass-q" if dep.cp > 1 else "local", sum(breakdown.values()), breakdown, detail)


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
