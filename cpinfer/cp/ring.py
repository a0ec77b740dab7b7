"""Ring neighbour exchange over an explicit process group (the only place group ranks become global ranks).

`start(send, recv)` posts one send to the next rank and one receive from the previous rank with
`batch_isend_irecv`; `wait()` completes them, so the caller computes the current block in between.
"""
from __future__ import annotations

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
