"""Ring pass-KV (paper §3.5.2, Alg. 2) and the Llama3-style all-gather K/V baseline.

Each rank packs the K/V rows that matter to the batch into one message (padded to the longest rank's, the
paper's max_i(P_i) + ceil(T/N) for partial prefill), then passes it around the ring N-1 times; the transfer of
the next block overlaps the attention on the current one. Partials merge into one fp32 accumulator. With a
sliding window (`run_direct`) each source sends each rank only the rows its queries can see, straight to it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cpinfer.attention.backends import backend_for
from cpinfer.attention.items import new_accumulator
from cpinfer.attention.kv_pack import pack_rows, row_width, unpack_rows
from cpinfer.attention.merge import finish
from cpinfer.attention.step import plan_tables
from cpinfer.cp.ring import direct_steps, ring_steps
from cpinfer.timing import Stopwatch


def _pack_kv(plan, k, v) -> torch.Tensor:
    """This rank's relevant K/V as one message [max_send, Hkv, W] (`kv_pack`: keys then values, or the keys alone
    when the values are in them; rows past its own count are padding)."""
    idx = plan_tables(plan, k.device)[plan.key("send")]  # [sent rows] int64, uploaded before the ring
    buf = k.new_zeros((plan.max_send, k.shape[1], row_width(k.shape[-1], v.shape[-1], plan.values_in_keys)))
    return pack_rows(k, v, plan.values_in_keys, buf, idx)


def run(plan, q, k, v, scale, timings=None, sinks=None) -> torch.Tensor:
    """q [Lq, H, D], k [Lkv, Hkv, D], v [Lkv, Hkv, Dv] → out [Lq, H, Dv] (the plan's tables prepared and uploaded);
    sinks [H] are merged once, after the last step."""
    backend = backend_for(plan, q.device)
    acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)

    def compute(j, block):  # step 0 reads my K/V in place; later steps the block received from rank - j
        kj, vj = (k, v) if j == 0 else unpack_rows(block, k.shape[-1], v.shape[-1])
        backend.attend(plan, j, q, kj, vj, acc_out, acc_lse, scale)

    ring_steps(plan.group, _pack_kv(plan, k, v) if plan.world > 1 else None, plan.world, compute, timings)
    return finish(acc_out, acc_lse, sinks, q.dtype)


def run_direct(plan, q, k, v, scale, timings=None, sinks=None) -> torch.Tensor:
    """Windowed / chunked pass-KV: at step j rank r receives from rank r - j the K/V rows its queries see
    (`plan.routes`); pairs with no such rows exchange nothing. q [Lq, H, D], k [Lkv, Hkv, D], v [Lkv, Hkv, Dv] →
    out [Lq, H, Dv]."""
    backend = backend_for(plan, q.device)
    acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)
    n, me, rows = plan.world, plan.rank, plan.routes.rows
    tables = plan_tables(plan, q.device)

    width = row_width(k.shape[-1], v.shape[-1], plan.values_in_keys)

    def outgoing(j):  # my rows the rank j ahead of me needs, packed [rows, Hkv, W]
        if not len(rows[me][(me + j) % n]):
            return None
        return pack_rows(k, v, plan.values_in_keys, idx=tables[plan.key("direct", (me + j) % n)])

    def incoming(j):
        count = len(rows[(me - j) % n][me])
        return k.new_empty((count, k.shape[1], width)) if count else None

    def compute(j, block):
        if plan.steps[j]:
            kj, vj = (k, v) if j == 0 else unpack_rows(block, k.shape[-1], v.shape[-1])
            backend.attend(plan, j, q, kj, vj, acc_out, acc_lse, scale)

    direct_steps(plan.group, n, outgoing, incoming, compute, timings, q.device)
    return finish(acc_out, acc_lse, sinks, q.dtype)


def run_all_gather(plan, q, k, v, scale, timings=None, sinks=None) -> torch.Tensor:
    """Baseline: all-gather every rank's packed K/V first (not overlapped), then attend locally."""
    backend = backend_for(plan, q.device)
    acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)
    clock = Stopwatch(q.device)
    t0 = clock.mark()
    blocks = [k, v]
    if plan.world > 1:
        mine = _pack_kv(plan, k, v)
        blocks = [torch.empty_like(mine) for _ in range(plan.world)]
        dist.all_gather(blocks, mine, group=plan.group)
    t1 = clock.mark()
    for j in range(plan.world):
        if j == 0:
            backend.attend(plan, 0, q, k, v, acc_out, acc_lse, scale)
        else:
            backend.attend(plan, j, q, *unpack_rows(blocks[plan.source(j)], k.shape[-1], v.shape[-1]), acc_out,
                           acc_lse, scale)
    if timings is not None:
        timings.append({"step": "all", "compute_s": clock.span(t1, clock.mark()), "wait_s": clock.span(t0, t1)})
    return finish(acc_out, acc_lse, sinks, q.dtype)
