"""Ring pass-Q (paper §3.5.3, Alg. 3) and batched ring pass-Q decode (§3.6, Alg. 4).

Queries travel the ring while K/V stay put; each rank keeps the partial (out, lse) it computed for every source
rank's queries, one All2All returns the partials to their source, and the source merges them. Query messages
are padded only to the longest rank's query count (decode places at most ceil(B/N) tokens on a rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cpinfer.attention.backends import backend_for
from cpinfer.cp.ring import ring_steps
from cpinfer.timing import Stopwatch


def run(plan, q, k, v, scale, timings=None) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lkv, Hkv, D] → out [Lq, H, D]."""
    backend = backend_for(plan, q.device)
    backend.prepare_plan(plan, q, k)  # device tables once per forward, before any ring step
    n, lq, h, d = plan.world, q.shape[0], q.shape[1], q.shape[2]
    rows = plan.max_q if n > 1 else lq
    # partials[s] = (out, lse) of source s's queries against my K/V, packed as [N, rows, H, D+1] for the All2All
    partials = torch.zeros(n, rows, h, d + 1, dtype=torch.float32, device=q.device)
    partials[..., d] = -torch.inf
    cur = q
    if n > 1:  # queries travel padded to the longest rank's count
        cur = q.new_zeros((rows, h, d))
        cur[:lq] = q

    def compute(j, block):  # block holds the queries that started on rank (rank - j)
        if plan.steps[j]:
            part = partials[plan.source(j)]
            backend.attend(plan, j, block, k, v, part[..., :d], part[..., d], scale)

    ring_steps(plan.group, cur, n, compute, timings)
    if n == 1:
        return partials[0, :lq, :, :d].to(q.dtype)
    clock = Stopwatch(q.device)  # CUDA events on CUDA: the host does not wait for NCCL
    t0 = clock.mark()
    back = torch.empty_like(partials)
    dist.all_to_all_single(back, partials, group=plan.group)  # back[s] = my queries' partial computed on rank s
    out, _ = backend.merge(back[:, :lq, :, :d], back[:, :lq, :, d], q.dtype)  # [Lq, H, D]
    if timings is not None:
        timings.append({"step": "all2all+merge", "compute_s": 0.0, "wait_s": clock.span(t0, clock.mark())})
    return out
