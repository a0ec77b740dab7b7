"""Ring neighbour exchange over an explicit process group (the only place group ranks become global ranks).

`start(send, recv)` posts one send to the next rank and one receive from the previous rank with
`batch_isend_irecv`; `wait()` completes them, so the caller computes the current block in between.
`direct_steps` is the windowed variant: step j goes straight from rank r - j to rank r, and a pair with nothing
to move posts nothing (a step that is empty for every rank moves no message at all).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def group_rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


class RingComm:
    def __init__(self, group):
        self.group = group
        self.rank, self.size = group_rank_and_size(group)
        self.next = global_rank(group, (self.rank + 1) % self.size)
        self.prev = global_rank(group, (self.rank - 1) % self.size)
        self._reqs = []

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self._reqs:
            raise RuntimeError("previous ring transfer not waited for")
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []


def ring_steps(group, block: torch.Tensor | None, n: int, compute, timings: list | None = None) -> None:
    """Run N ring steps: at step j, `compute(j, block_j)` runs while block_j travels on to the next rank.

    block_0 is this rank's own block; block_j is the one that started on rank (rank - j) mod N. With N == 1 there
    is no communication (block may be None). Appends {"step", "compute_s", "wait_s"} per step to `timings`.
    """
    ring = RingComm(group) if n > 1 else None
    spare = torch.empty_like(block) if n > 1 else None
    for j in range(n):
        t0 = time.perf_counter()
        if j < n - 1:
            ring.start(block, spare)  # send what I hold, receive the previous rank's
        compute(j, block)
        t1 = time.perf_counter()
        if j < n - 1:
            ring.wait()
            block, spare = spare, block
        if timings is not None:
            timings.append({"step": j, "compute_s": t1 - t0, "wait_s": time.perf_counter() - t1})


def direct_steps(group, n: int, outgoing, incoming, compute, timings: list | None = None) -> None:
    """N steps of a direct exchange: at step j (1 <= j < N) this rank sends `outgoing(j)` to rank (rank + j) and
    receives into `incoming(j)` from rank (rank - j); either may be None (nothing to move, no message posted —
    both sides decide from the same plan). `compute(j, block)` runs on step j's received block (None at j = 0 or
    when nothing came) while step j+1's transfers are in flight. Same timings as `ring_steps`.
    """
    rank = dist.get_rank(group) if n > 1 else 0

    def post(j: int):
        send, recv = outgoing(j), incoming(j)
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, global_rank(group, (rank + j) % n), group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, global_rank(group, (rank - j) % n), group))
        return (dist.batch_isend_irecv(ops) if ops else []), send, recv  # send kept alive until waited

    pending = post(1) if n > 1 else None
    for j in range(n):
        t0 = time.perf_counter()
        block = None
        if j > 0:
            reqs, _, block = pending
            for req in reqs:
                req.wait()
            pending = post(j + 1) if j + 1 < n else None
        t1 = time.perf_counter()
        compute(j, block)
        if timings is not None:
            timings.append({"step": j, "compute_s": time.perf_counter() - t1, "wait_s": t1 - t0})
