"""The recurrent layers of a linear-attention hybrid (Qwen3-Next / Qwen3.5 Gated DeltaNet, Kimi Linear KDA) in the
performance model: what cpinfer's engine does per layer (`cpinfer/engine/recurrent.py`), priced per device.

Prefill, on the rank with the most tokens (`tokens` rows, its shards of B sequences):

* the causal conv1d over q, k, v and the gated output norm: memory-bound passes;
* the chunked delta rule (the UT-transform form of `model/recurrent/gdn.py`, chunks of C = 64): per chunk and head
  K K^T, Q K^T (2 C^2 Dk each), the two triangular solves (C^2 Dk + C^2 Dv), the intra-chunk product (2 C^2 Dv),
  and against the carried state W S, Q S and the update K^T U (2 C Dk Dv each), so per token and head
  C (5 Dk + 3 Dv) + 6 Dk Dv FLOPs. Under CP (N > 1) a rank does not know its shards' starting states, so it runs the
  rule on the state augmented by an identity block (values Dv + Dk wide: the map and the outputs as a function of
  the starting state in one pass) and finishes each output with one [Dk] x [Dk, Dv] product: CP costs the
  recurrent layers (Dv + Dk) / Dv-wide work, about twice with Dk = Dv (KDA: the augmented pass for the map, then
  the plain rule from the starting state). A sequence's first chunk runs plainly, and its end state is relayed to
  the owner of the second, which runs that chunk plainly too: at CP2 each rank runs one of its two chunks plainly
  and the other augmented; from CP3 on the middle rank's two adjacent chunks are both augmented (the fullest rank);
* the summary exchange: the maps M [Dk, Dk] and B [Dk, Dv] per value head (fp32) of every long shard — 2N - 1 per
  sequence under the ring's 2N-chunk layout, the first two of them constant maps that ship B alone — in one
  all-reduce over the CP group, plus one of each shard's last kernel - 1 pre-conv rows (the conv halo): a fixed
  size per layer, independent of the sequence length.

Decode: each rank advances every sequence's state (the replicas stay on every rank): read and write the fp32 state
once per token; the decode rows (pre-conv inputs and side inputs) reach every rank in one all-reduce per layer.
The FLOPs run at the attention kernels' rate (the chunked rule is the same tensor-core matmul pattern); the state
and conv tail are kept per request on every CP rank, the heads split over the TP ranks.
"""
from __future__ import annotations

import math

from cpinfer.cp import cost_model
from cpinfer.cp.cost_model import Link
from cpinfer.perf.model_spec import ModelSpec

CHUNK = 64  # tokens per chunk of the chunked delta rule (gdn.DEFAULT_CHUNK, transformers' default)
CONV_PASSES = 2        # the conv reads its C pre-conv channels and writes the activated ones
NORM_PASSES = 4        # gated RMSNorm: read o and z, write the output (+ the fp32 cast of o)


def rule_flops(dk: int, dv: int, chunk: int = CHUNK) -> float:
    """FLOPs per token and head of the chunked delta rule with keys Dk and values Dv wide (module doc)."""
    return chunk * (5 * dk + 3 * dv) + 6 * dk * dv


def token_flops(m: ModelSpec, cp: int) -> float:
    """One token's recurrence FLOPs per value head on the fullest rank: the plain rule at CP1; under CP, a mapped
    token costs Gated DeltaNet the rule on Dv + Dk values (the map's identity block) and its output's correction
    from the starting state (2 Dk Dv), KDA (no outputs from the augmented pass in the engine) the augmented pass for
    the map, then the plain rule. At CP2 half of each rank's tokens run plainly (the relay, module doc)."""
    dk, dv = m.linear_k_dim, m.linear_v_dim
    plain = rule_flops(dk, dv)
    if cp <= 1:
        return plain
    mapped = rule_flops(dk, dv + dk) + (plain if m.linear_kind == "kda" else 2 * dk * dv)
    return (plain + mapped) / 2 if cp == 2 else mapped


def map_bytes(m: ModelSpec, tp: int) -> int:
    """One shard's affine map on one TP rank: M [Dk, Dk] and B [Dk, Dv] fp32 per value head."""
    return m.linear_v_heads // tp * m.linear_k_dim * (m.linear_k_dim + m.linear_v_dim) * 4


def cp_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """An all-reduce over the n CP ranks on the ring's link, the faster of NCCL's ring (2 (n - 1) steps of
    nbytes / n) and its tree (2 log2 n latencies, the bytes twice: what small messages get)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    ring = 2 * (n - 1) * (link.latency + nbytes / n / link.bandwidth)
    tree = 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / link.bandwidth
    return min(ring, tree)


def long_shards(cp: int, batch: int) -> int:
    """Shards whose map is exchanged: 2N - 1 per sequence (rank N-1's two chunks are adjacent: one shard)."""
    return batch * (2 * cp - 1) if cp > 1 else 0


def exchanged_map_bytes(m: ModelSpec, cp: int, tp: int, batch: int) -> int:
    """The map all-reduce's bytes per layer: every long shard's map, a sequence's first two as B alone (their end
    states: constant maps)."""
    if cp <= 1:
        return 0
    b = m.linear_v_heads // tp * m.linear_k_dim * m.linear_v_dim * 4
    return (long_shards(cp, batch) - 2 * batch) * map_bytes(m, tp) + 2 * batch * b


def prefill_layer(hw, m: ModelSpec, cp: int, tp: int, link: Link, tokens: int, batch: int,
                  act_bytes: int) -> dict:
    """One recurrent layer of a prefill on the fullest rank (`tokens` rows, `batch` sequences): seconds of the
    conv + rule + norm ("recurrence") and of the exchanges ("summary_exchange"), and the numbers behind them."""
    heads = m.linear_v_heads // tp
    channels = m.linear_conv_channels // tp
    vd = m.linear_v_heads * m.linear_v_dim // tp
    mem = cost_model.memory_rate(hw)
    passes = tokens * act_bytes * (CONV_PASSES * channels + NORM_PASSES * vd) / mem
    flops = tokens * heads * token_flops(m, cp)
    io = tokens * heads * (2 * m.linear_k_dim + 2 * m.linear_v_dim) * 4  # fp32 q, k, v in; o out
    rule = max(flops / cost_model.attention_rate(hw), io / mem)
    maps = exchanged_map_bytes(m, cp, tp, batch)
    halo = long_shards(cp, batch) * (m.linear_conv - 1) * channels * act_bytes
    exchange = cp_allreduce_time(maps, cp, link) + cp_allreduce_time(halo, cp, link)
    return dict(recurrence=passes + rule, summary_exchange=exchange, exchange_bytes=maps + halo,
                rule_flops=flops)


def decode_layer(hw, m: ModelSpec, cp: int, tp: int, link: Link, batch: int, rows: int, act_bytes: int) -> dict:
    """One recurrent layer of a decode step (`rows` per sequence): every rank reads and writes each of the `batch`
    sequences' fp32 states once, and gets the decode rows (pre-conv and side inputs) by one all-reduce."""
    heads = m.linear_v_heads // tp
    state = heads * m.linear_k_dim * m.linear_v_dim * 4
    mem = cost_model.memory_rate(hw)
    flops = batch * rows * heads * 6 * m.linear_k_dim * m.linear_v_dim  # decay, S^T k, the update, S^T q
    t = max(batch * 2 * state / mem, flops / cost_model.attention_rate(hw)) + hw.kernel_overhead_us * 1e-6
    side = m.linear_v_heads * (m.linear_v_dim + 2) // tp  # z, b, a (GDN) / the per-token side inputs
    row_bytes = batch * rows * (m.linear_conv_channels // tp + side) * act_bytes
    return dict(recurrence=t, summary_exchange=cp_allreduce_time(row_bytes, cp, link))


def state_gb(m: ModelSpec, tp: int, batch: int, act_bytes: int) -> float:
    """GB per device of `batch` requests' states (every CP rank keeps every request's replica)."""
    return batch * m.linear_state_bytes(tp, act_bytes) / 1e9 if m.linear_layers else 0.0
