"""The recurrent layers of a hybrid model on the static decode path (`decode_graph.py`): fixed shapes, every state
updated in place in the state store's tensors, so that the forward can be captured in a CUDA graph.

A decode forward gives each sequence one row. Every rank keeps a replica of every state (`kv/state_store.py`), so
every rank advances every decode row's state: under CP each rank's rows (the ring's, padded to the ring bucket, then
its local ones) are padded to `rows` = the ring bucket plus the largest local bucket of any rank (the same number on
every rank, from the batch), and one all-reduce of a zero-padded [ranks, rows, C + side] buffer per recurrent layer
gives every rank every row's pre-conv inputs and side inputs (fp32 when a side input is). Static buffers name each
gathered row's slots: the state it reads (`rec_in`), the ones it writes (`rec_out`, and `rec_copy` for a snapshot);
a padding row reads the store's zero row and writes its sink row. Rows run one after the other (a row's conv from
its slot's tail, its inputs, one step of the recurrence from its slot's state): the same arithmetic as the dynamic
path's (`recurrent.py`), which runs a decode token alone from its state too. A rank with no row of its own takes part
in the exchanges without running the model (`replicate`). Verify rows (speculative decoding) are left to the
dynamic path, which keeps their per-token states for a rollback.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from cpinfer.engine.batch import ForwardBatch


def slot_rows(batch: ForwardBatch, groups: list[list[int]], rows: int, zero: int, sink: int) -> dict[str, np.ndarray]:
    """The slots of every gathered row: groups[r] is rank r's sequences in its row order (None: a padding row; the
    rest up to `rows` padding too) ->
    {"rec_in", "rec_out", "rec_copy"} int64 [ranks x rows]."""
    n = len(groups)
    out = {"rec_in": np.full(n * rows, zero, dtype=np.int64), "rec_out": np.full(n * rows, sink, dtype=np.int64),
           "rec_copy": np.full(n * rows, sink, dtype=np.int64)}
    for r, seqs in enumerate(groups):
        if len(seqs) > rows:
            raise RuntimeError(f"rank {r} has {len(seqs)} decode rows, the exchange takes {rows} (this is a bug)")
        for i, b in enumerate(seqs):
            if b is None:  # a padding row
                continue
            s = batch.seqs[b]
            out["rec_in"][r * rows + i] = s.state_in if s.state_in >= 0 else zero
            out["rec_out"][r * rows + i] = s.state_out if s.state_out >= 0 else sink
            out["rec_copy"][r * rows + i] = s.state_copy if s.state_copy >= 0 else sink
    return out


class StaticRecurrence:
    """The static path's `RecurrentFn` for one bucket: `bind(buffers, rows)`, then the model's forward calls it."""

    def __init__(self, runner, rank: int, world: int, group):
        self.runner, self.rank, self.world, self.group = runner, rank, world, group
        self.buffers, self.rows = None, 0

    def bind(self, buffers, rows: int) -> "StaticRecurrence":
        """Use a bucket's static buffers (its rec_in / rec_out / rec_copy) and its rows per rank."""
        self.buffers, self.rows = buffers, rows
        return self

    def __call__(self, layer: int, mixer: nn.Module, u: Tensor | None, side: tuple | None) -> Tensor | None:
        """u [my padded rows, C] and side (None on a rank that only replicates) -> o [my padded rows, H, Dv] fp32."""
        store = self.runner.states
        dtype, dev = store.dtype, store.device
        n, rows = self.world, self.rows
        if n > 1:
            u_all, sides = self._exchange(mixer, u, side, dtype, dev)
        else:
            u_all, sides = u, side
        states, tails = store.states[layer], store.tails[layer]
        buf = self.buffers
        s_in, s_out, s_copy = buf[("rec_in",)], buf[("rec_out",)], buf[("rec_copy",)]
        outs = []
        for i in range(n * rows):
            at = slice(i, i + 1)
            state = states.index_select(0, s_in[at])[0]
            tail = tails.index_select(0, s_in[at])[0]
            conv, tail = mixer.conv(u_all[at], tail)
            o, state = mixer.run(mixer.inputs(conv, tuple(x[at] for x in sides)), state)
            for idx in (s_out, s_copy):
                states.index_copy_(0, idx[at], state[None])
                tails.index_copy_(0, idx[at], tail[None].to(tails.dtype))
            outs.append(o)
        if u is None:
            return None
        o = torch.cat(outs)  # [n x rows, H, Dv]
        mine = self.rank * rows if n > 1 else 0
        return o[mine:mine + u.shape[0]]

    def _exchange(self, mixer, u, side, dtype, dev) -> tuple[Tensor, tuple]:
        """Every rank's rows (pre-conv inputs and side inputs) on every rank: [ranks x rows, ...]."""
        n, rows, c = self.world, self.rows, mixer.conv_channels
        shapes = mixer.side_shapes
        widths = [int(np.prod(x)) for x in shapes]
        fp32 = getattr(mixer, "side_fp32", None) or (False,) * len(widths)
        ship = torch.float32 if any(fp32) else dtype
        buf = torch.zeros(n, rows, c + sum(widths), dtype=ship, device=dev)
        if u is not None:
            mine = u.shape[0]
            buf[self.rank, :mine, :c] = u
            buf[self.rank, :mine, c:] = torch.cat([x.reshape(mine, -1) for x in side], dim=1)
        dist.all_reduce(buf, group=self.group)
        flat = buf.view(n * rows, -1)
        parts = torch.split(flat[:, c:], widths, dim=1)
        sides = tuple(x.reshape(n * rows, *shape).to(torch.float32 if f else dtype)
                      for x, shape, f in zip(parts, shapes, fp32))
        return flat[:, :c].to(dtype), sides

    def replicate(self, model: nn.Module) -> None:
        """A rank with no row of its own: every recurrent layer's exchange and state updates, in layer order."""
        for layer in model.model.layers:
            if getattr(layer, "recurrent", False):
                self(layer.linear_attn.layer_idx, layer.linear_attn, None, None)
