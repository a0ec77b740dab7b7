"""Costs of the primitives one forward pass is made of: GEMM, attention block, flash-decoding, merge, collectives.

All times are seconds on one device; flops, bytes and rates are SI units. A kernel takes the longer of its compute
time and its memory time (a roofline). Compute rates carry their shape effects: GEMMs pay for partly filled
128-row tiles, attention pays a fixed cost of L0 keys per query row-tile (the FA3 prologue/epilogue), so short
blocks run slower, as the paper's 540 TF/s at 8K and its per-op attention scaling (§4.3) describe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cpinfer.perf.hardware import HardwareProfile
from cpinfer.utils import ceil_div

LSE_BYTES = 4      # the log-sum-exp of a partial output is kept in fp32 (DESIGN.md, Numerics)
GEMM_TILE_M = 128  # rows of one GEMM tile on Hopper (CUTLASS / FBGEMM FP8 kernels); a partial tile costs a full one


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
    """One prefill attention kernel: `pairs` visible (query, key) pairs of lq queries against lkv keys.

    FLOPs = 4 * pairs * head_dim * heads (QK^T and PV, paper Table 3, App. A). Each query row pays L0 keys' worth
    of fixed work (attn_overhead_tokens), so a causal square of L runs at A_inf * (L/2) / (L/2 + L0).
    """
    if pairs <= 0:
        return 0.0
    work = 4.0 * (pairs + lq * hw.attn_overhead_tokens) * shape.head_dim * shape.heads
    traffic = 2 * shape.q_bytes(lq) + shape.kv_bytes(lkv)  # read Q, K, V; write O
    return max(work / hw.attn_flops_per_s(), traffic / hw.mem_bytes_per_s)


def decode_attention_time(hw: HardwareProfile, shape: AttnShape, queries: int, keys: float) -> float:
    """Flash-decoding (paper §4.1: K/V split 256 ways) of `queries` single-token queries, `keys` cached keys each.

    Two kernels (split attention, then the combine of the splits) whose time is reading K/V once; under CUDA graphs
    each still costs at least one kernel slot.
    """
    if queries <= 0 or keys <= 0:
        return 0.0
    traffic = queries * (shape.kv_bytes(keys) + 2 * shape.q_bytes(1))
    combine = queries * shape.heads * DECODE_SPLITS * (shape.head_dim + 1) * 4 / hw.mem_bytes_per_s
    slot = hw.kernel_overhead_us * 1e-6
    return max(slot, traffic / hw.mem_bytes_per_s) + max(slot, combine)


DECODE_SPLITS = 256  # paper §4.1: Flash Decoding with 256 K/V splits


def merge_time(hw: HardwareProfile, shape: AttnShape, lq: float, parts: int) -> float:
    """Merge `parts` partial outputs (App. B): read each and its LSE in fp32, write the output once."""
    if parts <= 1:
        return 0.0
    traffic = parts * lq * shape.heads * (shape.head_dim + 1) * 4 + shape.q_bytes(lq)
    return traffic / hw.mem_bytes_per_s


def gemm_time(hw: HardwareProfile, m: int, n: int, k: int, weight_bytes: float, fp8: bool) -> float:
    """One [m, k] x [k, n] GEMM: 2mnk FLOPs at the dtype's achieved rate, rows rounded up to whole 128-row tiles
    (below one tile, decode's GEMV-like kernels size their tiles to m), or the weight read, whichever is longer."""
    if m <= 0:
        return 0.0
    rows = ceil_div(m, GEMM_TILE_M) * GEMM_TILE_M if m > GEMM_TILE_M else m
    flops = 2.0 * rows * n * k
    return max(flops / hw.gemm_flops_per_s(fp8), weight_bytes / hw.mem_bytes_per_s)


def p2p_time(nbytes: float, link: tuple[float, float]) -> float:
    """One SendRecv of nbytes over a (bytes/s, latency s) link; both directions run at once."""
    bandwidth, latency = link
    return latency + nbytes / bandwidth if nbytes > 0 else 0.0


def all2all_time(bytes_per_peer: float, n: int, link: tuple[float, float]) -> float:
    """All2All across n ranks as a pairwise exchange: n-1 rounds, each one message's latency + bytes / bandwidth
    (the alpha-beta cost of the pass-Q merge's All2All, App. C)."""
    if n <= 1:
        return 0.0
    bandwidth, latency = link
    return (n - 1) * (latency + bytes_per_peer / bandwidth)


def allreduce_time(hw: HardwareProfile, nbytes: float, tp: int) -> float:
    """All-reduce of nbytes over tp devices (paper §4.2.2). Inside a node: NVLink ring. Across nodes:
    reduce-scatter in the node, all-reduce of the 1/local slice over the network, all-gather in the node."""
    if tp <= 1:
        return 0.0
    local = min(tp, hw.devices_per_node)
    t = hw.intra_latency_us * 1e-6 + 2 * (local - 1) / local * nbytes / (hw.intra_gbs * 1e9)
    nodes = tp // local
    if nodes > 1:  # NCCL's tree for the latency (2 log2 hops), the ring's bytes at the collective bandwidth
        t += 2 * math.ceil(math.log2(nodes)) * hw.inter_latency_us * 1e-6 + \
            2 * (nodes - 1) / nodes * (nbytes / local) / (hw.inter_coll_gbs * 1e9)
    return t
