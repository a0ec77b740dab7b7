"""A single-device `RecurrentFn` (tests, the model run alone): each sequence's conv tails and states per layer kept
across forwards in dicts, the rows of one sequence contiguous and in order in each forward."""
from __future__ import annotations

import torch
from torch import Tensor, nn


class ReferenceRecurrence:
    """`set_batch(seq_ids)` before each forward (one id per packed token); `states[(seq, layer)]` and
    `tails[(seq, layer)]` hold what the next forward of that sequence continues from (zeros when absent)."""

    def __init__(self) -> None:
        self.states: dict[tuple, Tensor] = {}
        self.tails: dict[tuple, Tensor] = {}
        self.seq_ids: list = []

    def set_batch(self, seq_ids) -> None:
        self.seq_ids = [int(s) for s in seq_ids]

    def __call__(self, layer: int, mixer: nn.Module, u: Tensor, side: tuple) -> Tensor:
        if len(self.seq_ids) != u.shape[0]:
            raise ValueError(f"set_batch gave {len(self.seq_ids)} sequence ids for {u.shape[0]} tokens")
        h, _, dv = mixer.state_shape
        out = u.new_zeros(u.shape[0], h, dv, dtype=torch.float32)
        start = 0
        while start < len(self.seq_ids):
            seq = self.seq_ids[start]
            end = start
            while end < len(self.seq_ids) and self.seq_ids[end] == seq:
                end += 1
            key = (seq, layer)
            tail = self.tails.get(key)
            if tail is None:
                tail = u.new_zeros(mixer.kernel - 1, u.shape[1])
            conv, self.tails[key] = mixer.conv(u[start:end], tail)
            inp = mixer.inputs(conv, tuple(x[start:end] for x in side))
            out[start:end], self.states[key] = mixer.run(inp, self.states.get(key))
            start = end
        return out
