"""Ring pass-Q (paper §3.5.3, Alg. 3) and batched ring pass-Q decode (§3.6, Alg. 4).

Queries travel the ring while K/V stay put; each rank keeps the partial (out, lse) it computed for every source
rank's queries, one All2All returns the partials to their source, and the source merges them. Query messages
are padded only to the longest rank's query count (decode places at most ceil(B/N) tokens on a rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cpinfer.attention.backends import backend_for
from cpinfer.attention.merge import merge_sink
from cpinfer.attention.step import plan_tables
from cpinfer.cp.ring import direct_steps, ring_steps
from cpinfer.timing import Stopwatch


def _merged(backend, outs, lses, sinks, dtype) -> torch.Tensor:
    """The source's merge of its queries' partials (outs [S, L, H, D], lses [S, L, H]) → out [L, H, D] in dtype,
    with the sinks [H] merged once at the end (in fp32) when given."""
    if outs.shape[0] == 1:  # one partial (CP1, or nothing crossed ranks): already merged
        if sinks is None:
            return outs[0].to(dtype)
        out, lse = outs[0].float(), lses[0].float()  # fp32 views of buffers no one reads afterwards
    elif sinks is None:
        return backend.merge(outs, lses, dtype)[0]
    else:
        out, lse = backend.merge(outs, lses, torch.float32)
    merge_sink(out, lse, sinks)
    return out.to(dtype)


def run(plan, q, k, v, scale, timings=None, sinks=None) -> torch.Tensor:
    """q [Lq, H, D], k [Lkv, Hkv, D], v [Lkv, Hkv, Dv] → out [Lq, H, Dv]; sinks [H] merged once, after the All2All's
    merge."""
    backend = backend_for(plan, q.device)  # the plan's tables are prepared and uploaded
    n, lq, h, d = plan.world, q.shape[0], q.shape[1], v.shape[-1]
    rows = plan.max_q if n > 1 else lq
    # partials[s] = (out, lse) of source s's queries against my K/V, packed as [N, rows, H, Dv+1] for the All2All
    partials = torch.zeros(n, rows, h, d + 1, dtype=torch.float32, device=q.device)
    partials[..., d].fill_(-torch.inf)
    cur = q
    if n > 1:  # queries travel padded to the longest rank's count
        cur = q.new_zeros((rows, h, q.shape[2]))
        cur[:lq] = q

    def compute(j, block):  # block holds the queries that started on rank (rank - j)
        if plan.steps[j]:
            part = partials[plan.source(j)]
            backend.attend(plan, j, block, k, v, part[..., :d], part[..., d], scale)

    ring_steps(plan.group, cur, n, compute, timings)
    if n == 1:
        return _merged(backend, partials[:, :lq, :, :d], partials[:, :lq, :, d], sinks, q.dtype)
    clock = Stopwatch(q.device)  # CUDA events on CUDA: the host does not wait for NCCL
    t0 = clock.mark()
    back = torch.empty_like(partials)
    dist.all_to_all_single(back, partials, group=plan.group)  # back[s] = my queries' partial computed on rank s
    out = _merged(backend, back[:, :lq, :, :d], back[:, :lq, :, d], sinks, q.dtype)  # [Lq, H, D]
    if timings is not None:
        timings.append({"step": "all2all+merge", "compute_s": 0.0, "wait_s": clock.span(t0, clock.mark())})
    return out


def run_direct(plan, q, k, v, scale, timings=None, sinks=None) -> torch.Tensor:
    """Windowed / chunked pass-Q: at step j rank r receives from rank r - j the queries that see some key of r
    (`plan.routes`), attends them to its K/V in place, and an All2All with per-pair sizes returns the partials;
    pairs with nothing to move exchange nothing. q [Lq, H, D], k [Lkv, Hkv, D], v [Lkv, Hkv, Dv] → out [Lq, H, Dv]."""
    backend = backend_for(plan, q.device)
    n, me, rows = plan.world, plan.rank, plan.routes.rows
    (lq, h, dq), d = q.shape, v.shape[-1]
    tables = plan_tables(plan, q.device)
    own = torch.zeros(lq, h, d + 1, dtype=torch.float32, device=q.device)  # my queries against my K/V
    own[..., d].fill_(-torch.inf)
    parts: dict[int, torch.Tensor] = {}  # source rank -> [rows, H, D+1] partial of its queries against my K/V

    def index(dst):  # [rows] int64: my queries that see some key of rank dst (uploaded before the ring)
        return tables[plan.key("direct", dst)]

    def outgoing(j):
        dst = (me + j) % n
        return q.index_select(0, index(dst)) if len(rows[me][dst]) else None

    def incoming(j):
        count = len(rows[(me - j) % n][me])
        return q.new_empty((count, h, dq)) if count else None

    def compute(j, block):
        if j == 0:
            if plan.steps[0]:
                backend.attend(plan, 0, q, k, v, own[..., :d], own[..., d], scale)
            return
        if block is None:
            return
        part = torch.zeros(block.shape[0], h, d + 1, dtype=torch.float32, device=q.device)
        part[..., d].fill_(-torch.inf)
        if plan.steps[j]:
            backend.attend(plan, j, block, k, v, part[..., :d], part[..., d], scale)
        parts[(me - j) % n] = part

    direct_steps(plan.group, n, outgoing, incoming, compute, timings, q.device)
    if not any(plan.routes.count(s, r) for s in range(n) for r in range(n)):  # nothing crossed ranks: no All2All
        return _merged(backend, own[None, :, :, :d], own[None, :, :, d], sinks, q.dtype)
    clock = Stopwatch(q.device)
    t0 = clock.mark()
    send_sizes = [len(rows[s][me]) if s != me else 0 for s in range(n)]  # partials back to each source
    recv_sizes = [len(rows[me][r]) if r != me else 0 for r in range(n)]  # my queries' partials from each rank
    send = torch.cat([parts[s] for s in range(n) if send_sizes[s]] or [own[:0]])
    back = own.new_empty((sum(recv_sizes), h, d + 1))
    dist.all_to_all_single(back, send, recv_sizes, send_sizes, group=plan.group)
    stacked = own.new_zeros((n, lq, h, d + 1))  # [N, Lq, H, D+1]: slot r the partial from rank r (mine at me)
    stacked[..., d].fill_(-torch.inf)
    stacked[me] = own
    at = 0
    for r in range(n):
        if recv_sizes[r]:
            stacked[r, index(r)] = back[at:at + recv_sizes[r]]
            at += recv_sizes[r]
    out = _merged(backend, stacked[..., :d], stacked[..., d], sinks, q.dtype)  # [Lq, H, D]
    if timings is not None:
        timings.append({"step": "all2all+merge", "compute_s": 0.0, "wait_s": clock.span(t0, clock.mark())})
    return out
