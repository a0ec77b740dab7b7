"""Ring neighbour exchange over an explicit process group (the only place group ranks become global ranks).

`start(send, recv)` posts one send to the next rank and one receive from the previous rank with
`batch_isend_irecv`; `wait()` completes them, so the caller computes the current block in between. gloo's
send / recv take host memory only, so CUDA tensors on a gloo group (ranks sharing one GPU) go through host copies.
`direct_steps` is the windowed variant: step j goes straight from rank r - j to rank r, and a pair with nothing
to move posts nothing (a step that is empty for every rank moves no message at all).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cpinfer.timing import Stopwatch


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
        self._host = dist.get_backend(group) == "gloo"  # gloo send / recv read raw host pointers
        self._reqs = []
        self._staged = None  # (device recv tensor, host recv buffer) while a staged transfer is in flight

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self._reqs:
            raise RuntimeError("previous ring transfer not waited for")
        if self._host and send.device.type != "cpu":
            host_recv = torch.empty(recv.shape, dtype=recv.dtype)
            self._staged = (recv, host_recv)
            send, recv = send.cpu(), host_recv  # blocking copy: the block is complete before it leaves
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        if self._staged is not None:
            recv, host = self._staged
            recv.copy_(host)
            self._staged = None


def ring_steps(group, block: torch.Tensor | None, n: int, compute, timings: list | None = None) -> None:
    """Run N ring steps: at step j, `compute(j, block_j)` runs while block_j travels on to the next rank.

    block_0 is this rank's own block; block_j is the one that started on rank (rank - j) mod N. With N == 1 there
    is no communication (block may be None). Appends {"step", "compute_s", "wait_s"} per step to `timings`: on
    CUDA these are pending `cpinfer.timing.Span`s on the compute stream (read them after the forward with
    `cpinfer.timing.resolve`); "wait_s" is the time the stream stood still for the transfer (exposed comm).
    """
    ring = RingComm(group) if n > 1 else None
    if n > 1:
        block = block.contiguous()  # send / recv need dense memory (a query may be a view of a fused projection)
    spare = torch.empty_like(block) if n > 1 else None
    clock = Stopwatch(block.device if block is not None else "cpu") if timings is not None else None
    for j in range(n):
        t0 = clock.mark() if clock else None
        if j < n - 1:
            ring.start(block, spare)  # send what I hold, receive the previous rank's
        compute(j, block)
        t1 = clock.mark() if clock else None
        if j < n - 1:
            ring.wait()
            block, spare = spare, block
        if clock:
            timings.append({"step": j, "compute_s": clock.span(t0, t1), "wait_s": clock.span(t1, clock.mark())})


def direct_steps(group, n: int, outgoing, incoming, compute, timings: list | None = None, device="cpu") -> None:
    """N steps of a direct exchange: at step j (1 <= j < N) this rank sends `outgoing(j)` to rank (rank + j) and
    receives into `incoming(j)` from rank (rank - j); either may be None (nothing to move, no message posted —
    both sides decide from the same plan). `compute(j, block)` runs on step j's received block (None at j = 0 or
    when nothing came) while step j+1's transfers are in flight. Same timings as `ring_steps` (`device`: where the
    blocks live, for the clock).
    """
    rank = dist.get_rank(group) if n > 1 else 0
    host = n > 1 and dist.get_backend(group) == "gloo"  # gloo send / recv read raw host pointers
    clock = Stopwatch(device) if timings is not None else None

    def post(j: int):
        send, recv = outgoing(j), incoming(j)
        staged = recv
        if host and send is not None and send.device.type != "cpu":
            send = send.cpu()  # blocking copy: the block is complete before it leaves
        if host and recv is not None and recv.device.type != "cpu":
            staged = torch.empty(recv.shape, dtype=recv.dtype)
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, global_rank(group, (rank + j) % n), group))
        if staged is not None:
            ops.append(dist.P2POp(dist.irecv, staged, global_rank(group, (rank - j) % n), group))
        return (dist.batch_isend_irecv(ops) if ops else []), send, recv, staged  # send kept alive until waited

    pending = post(1) if n > 1 else None
    for j in range(n):
        t0 = clock.mark() if clock else None
        block = None
        if j > 0:
            reqs, _, block, staged = pending
            for req in reqs:
                req.wait()
            if staged is not block:
                block.copy_(staged)  # a host-staged receive (CUDA tensors over gloo)
            pending = post(j + 1) if j + 1 < n else None
        t1 = clock.mark() if clock else None
        compute(j, block)
        if clock:
            timings.append({"step": j, "compute_s": clock.span(t1, clock.mark()), "wait_s": clock.span(t0, t1)})
