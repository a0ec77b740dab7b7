"""Roofline costs of the primitives one forward pass is made of: GEMM, attention block, merge, collectives.

All times are seconds on one device; flops, bytes and rates are SI units. Compute-bound kernels run at the
profile's achieved rate, memory-bound ones at its achieved bandwidth, whichever is slower (a roofline).
"""
from __future__ import annotations

from dataclasses import dataclass

from cpinfer.perf.hardware import HardwareProfile

LSE_BYTES = 4  # the log-sum-exp of a partial output is kept in fp32 (DESIGN.md, Numerics)


@dataclass(frozen=True)
class AttnShape:
    """Attention heads one GPU holds (after TP sharding) and the element size of Q/K/V/O."""
    heads: int      # query heads per GPU
    kv_heads: int   # KV heads per GPU
    head_dim: int
    elem_bytes: int

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "elem_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"attention shape: {name} must be positive, got {getattr(self, name)}")

    def q_bytes(self, tokens: float) -> float:       # Q (or O) of `tokens` queries
        return tokens * self.heads * self.head_dim * self.elem_bytes

    def kv_bytes(self, tokens: float) -> float:      # K and V of `tokens` keys
        return 2 * tokens * self.kv_heads * self.head_dim * self.elem_bytes

    def partial_out_bytes(self, tokens: float) -> float:  # a partial output plus its LSE (pass-Q All2All)
        return tokens * self.heads * (self.head_dim * self.elem_bytes + LSE_BYTES)


def attention_time(hw: HardwareProfile, shape: AttnShape, pairs: float, lq: float, lkv: float) -> float:
    """One attention kernel: `pairs` visible (query, key) pairs out of lq queries and lkv keys read.

    FLOPs = 4 * pairs * head_dim * heads (QK^T and PV, multiply + add), as in paper Table 3 and App. A.
    """
    if pairs <= 0:
        return 0.0
    flops = 4.0 * pairs * shape.head_dim * shape.heads
    traffic = 2 * shape.q_bytes(lq) + shape.kv_bytes(lkv)  # read Q, K, V; write O
    return max(flops / (hw.attn_tflops * 1e12), traffic / hw.mem_bytes_per_s)


def merge_time(hw: HardwareProfile, shape: AttnShape, lq: float, parts: int) -> float:
    """Merge `parts` partial outputs (App. B): read them and their LSE in fp32, write the output once."""
    if parts <= 1:
        return 0.0
    traffic = parts * lq * shape.heads * (shape.head_dim + 1) * 4 + shape.q_bytes(lq)
    return traffic / hw.mem_bytes_per_s


def gemm_time(hw: HardwareProfile, flops: float, weight_bytes: float, fp8: bool) -> float:
    """A GEMM group: compute-bound on large token counts, weight-read-bound on decode."""
    return max(flops / hw.gemm_flops_per_s(fp8), weight_bytes / hw.mem_bytes_per_s)


def p2p_time(nbytes: float, link: tuple[float, float]) -> float:
    """One SendRecv of nbytes over a (bytes/s, latency s) link; both directions run at once."""
    bandwidth, latency = link
    return latency + nbytes / bandwidth if nbytes > 0 else 0.0


def all2all_time(bytes_per_peer: float, n: int, link: tuple[float, float]) -> float:
    """All2All across n ranks: each rank's NIC sends n-1 messages (pass-Q merge, App. C)."""
    if n <= 1:
        return 0.0
    bandwidth, latency = link
    return latency + (n - 1) * bytes_per_peer / bandwidth


def allreduce_time(hw: HardwareProfile, nbytes: float, tp: int) -> float:
    """Ring all-reduce of nbytes over tp devices; hierarchical when TP spans nodes (paper §4.2.2)."""
    if tp <= 1:
        return 0.0
    local = min(tp, hw.devices_per_node)
    t = hw.intra_latency_us * 1e-6 + 2 * (local - 1) / local * nbytes / (hw.intra_gbs * 1e9)
    nodes = tp // local
    if nodes > 1:  # reduce-scatter in node, all-reduce the 1/local slice across nodes, all-gather in node
        t += hw.inter_latency_us * 1e-6 + 2 * (nodes - 1) / nodes * (nbytes / local) / (hw.inter_gbs * 1e9)
    return t
