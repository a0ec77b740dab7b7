"""Costs of the dense parts of a forward pass: GEMM (dtype, tiles), flash-decoding, TP all-reduce (paper §3.4, §4.1).

All times are seconds on one device; flops, bytes and rates are SI units. A kernel takes the longer of its compute
time and its memory time (a roofline). GEMMs pay for partly filled 128-row tiles. The ring-attention parts (prefill
attention blocks, SendRecv, All2All, merge) are the shared cost model `cpinfer/cp/cost_model.py`.
"""
from __future__ import annotations

import math

from cpinfer.cp.cost_model import AttnShape, attention_rate, memory_rate
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.utils import ceil_div

GEMM_TILE_M = 128  # rows of one GEMM tile on Hopper (CUTLASS / FBGEMM FP8 kernels); a partial tile costs a full one
DECODE_SPLITS = 256  # paper §4.1: Flash Decoding with 256 K/V splits


def decode_attention_time(hw: HardwareProfile, shape: AttnShape, queries: int, keys: float, rows: int = 1) -> float:
    """Flash-decoding (paper §4.1: K/V split 256 ways) of `queries` sequences, `keys` cached keys each, with `rows`
    query rows per sequence (1 for decode; k + 1 for a speculative verify step, whose rows share one K/V read).

    Two kernels (split attention, then the combine of the splits) whose time is reading K/V once per sequence (or
    the rows' FLOPs, if longer); under CUDA graphs each still costs at least one kernel slot.
    """
    if queries <= 0 or keys <= 0:
        return 0.0
    traffic = queries * (shape.kv_bytes(keys) + 2 * rows * shape.q_bytes(1))
    flops = 4.0 * queries * rows * keys * (shape.pair_dim or shape.head_dim) * shape.heads
    combine = queries * rows * shape.heads * DECODE_SPLITS * (shape.head_dim + 1) * 4 / memory_rate(hw)
    slot = hw.kernel_overhead_us * 1e-6
    return max(slot, traffic / memory_rate(hw), flops / attention_rate(hw)) + max(slot, combine)


def gemm_time(hw: HardwareProfile, m: int, n: int, k: int, weight_bytes: float, fp8: bool) -> float:
    """One [m, k] x [k, n] GEMM: 2mnk FLOPs at the dtype's achieved rate, rows rounded up to whole 128-row tiles
    (below one tile, decode's GEMV-like kernels size their tiles to m), or the weight read, whichever is longer."""
    if m <= 0:
        return 0.0
    rows = ceil_div(m, GEMM_TILE_M) * GEMM_TILE_M if m > GEMM_TILE_M else m
    flops = 2.0 * rows * n * k
    return max(flops / hw.gemm_flops_per_s(fp8), weight_bytes / memory_rate(hw))


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
