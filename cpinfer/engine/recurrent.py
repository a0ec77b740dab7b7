"""The rank side of the recurrent layers (hybrid families): one `RecurrentFn` per forward that runs every recurrent
layer's conv and recurrence for the batch's sequences from their state slots, exact under any CP sharding.

Per recurrent layer, with N > 1 CP ranks (mixer-agnostic: any mixer with the staged shape of
`model/recurrent/__init__.py`: `conv`, `inputs`, `run`, `summary`, `kernel`, `conv_channels`, `state_shape`):

1. halo exchange: each shard (a run of consecutive new tokens of one sequence on one rank) publishes its last
   kernel - 1 pre-conv rows (one all-reduce of a zero-padded [shards, K-1, C] buffer, in an order every rank
   derives from the batch). Every row a shard's conv needs before its first token is among the last K-1 rows of
   an earlier shard, or in the sequence's cached tail (the state slot's).
2. each rank convolves its shards, computes their recurrence inputs and their affine maps (`summary`);
3. summary exchange: one all-reduce of the [shards, |M| + |B|] fp32 maps (fixed size per shard, independent of
   its length);
4. every rank composes, per sequence in order, the maps of the shards before each of its own into that shard's
   starting state (from the sequence's state_in slot), runs its shards, and — every rank, not only those with
   tokens — composes all of them into the sequence's final state, which it writes with the new conv tail into the
   state_out slot of its replica. A rank with no token in the forward still takes part (`replicate`).

With one rank the shards run one after the other from the state slot (no summary, no exchange).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from cpinfer.engine.batch import ForwardBatch
from cpinfer.engine.kv.state_store import StateStore
from cpinfer.model.recurrent.affine import Affine, compose


class Shard:
    """Tokens a..e-1 (offsets in the sequence's new tokens) of sequence b, on rank r; `rows` [e - a] its rows of
    the forward's packed tokens when r is this rank."""

    __slots__ = ("b", "r", "a", "e", "rows", "index")

    def __init__(self, b: int, r: int, a: int, e: int, index: int):
        self.b, self.r, self.a, self.e, self.index = b, r, a, e, index
        self.rows: np.ndarray | None = None


def shards_of(batch: ForwardBatch) -> list[list[Shard]]:
    """Per sequence, its shards in sequence order (the same list on every rank)."""
    out, index = [], 0
    for b, s in enumerate(batch.seqs):
        ranks = np.asarray(s.ranks)
        cuts = np.flatnonzero(np.diff(ranks)) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = np.concatenate((cuts, [len(ranks)])).tolist()
        seq = []
        for a, e in zip(starts, ends):
            if e > a:
                seq.append(Shard(b, int(ranks[a]), a, e, index))
                index += 1
        out.append(seq)
    return out


class RecurrentRunner:
    """The `RecurrentFn` of one forward on one CP rank (see the module doc). `rows_of(b)`: this rank's rows of
    sequence b's new tokens, in offset order (from the attention plan)."""

    def __init__(self, batch: ForwardBatch, rank: int, world: int, group, store: StateStore, rows_of):
        self.batch, self.rank, self.world, self.group, self.store = batch, rank, world, group, store
        self.seqs = shards_of(batch)
        self.num_shards = sum(len(s) for s in self.seqs)
        for seq in self.seqs:
            mine = [sh for sh in seq if sh.r == rank]
            if mine:
                rows = np.asarray(rows_of(seq[0].b), dtype=np.int64)  # this rank's rows, offset order
                at = 0
                for sh in mine:
                    sh.rows = rows[at:at + sh.e - sh.a]
                    at += sh.e - sh.a
        top = max([max(s.state_in, s.state_out, s.state_copy) for s in batch.seqs] + [-1])
        store.ensure(top + 1)
        self.exchange_s = 0.0  # seconds in the exchanges, for benchmarks

    # ---------------------------------------------------------------- one layer
    def __call__(self, layer: int, mixer: nn.Module, u: Tensor | None, side: tuple | None) -> Tensor | None:
        """u [L, C] and side (this rank's rows; None on a rank that replicates only) -> o [L, H, Dv] fp32."""
        k1, (h, dk, dv) = mixer.kernel - 1, mixer.state_shape
        dtype = u.dtype if u is not None else self.store.dtype
        dev = u.device if u is not None else self.store.device
        out = None if u is None else torch.zeros(u.shape[0], h, dv, dtype=torch.float32, device=dev)
        if self.world == 1:
            for seq in self.seqs:
                self._run_alone(layer, mixer, seq, u, side, out)
            return out
        # 1. the last K-1 pre-conv rows of every shard, to everyone
        halo = torch.zeros(self.num_shards, k1, mixer.conv_channels, dtype=dtype, device=dev)
        for seq in self.seqs:
            for sh in seq:
                if sh.r == self.rank:
                    rows = u[torch.as_tensor(sh.rows[-k1:], device=dev)]
                    halo[sh.index, k1 - rows.shape[0]:] = rows
        self._all_reduce(halo)
        # 2. conv, inputs, maps of my shards
        m_size, b_size = h * dk * dk, h * dk * dv
        maps = torch.zeros(self.num_shards, m_size + b_size, dtype=torch.float32, device=dev)
        inputs = {}
        for seq in self.seqs:
            if not any(sh.r == self.rank for sh in seq):
                continue
            _, tail_in = self.store.load(layer, self.batch.seqs[seq[0].b].state_in)
            for sh in seq:
                if sh.r != self.rank:
                    continue
                idx = torch.as_tensor(sh.rows, device=dev)
                conv, _ = mixer.conv(u[idx], self._before(seq, sh.a, tail_in, halo, k1))
                inp = mixer.inputs(conv, tuple(x[idx] for x in side))
                inputs[sh.index] = inp
                maps[sh.index] = mixer.summary(inp).to_tensor()
        # 3. every shard's map, to everyone
        self._all_reduce(maps)
        # 4. starting states, my outputs, every sequence's final state and tail
        for seq in self.seqs:
            s = self.batch.seqs[seq[0].b]
            state, tail_in = self.store.load(layer, s.state_in)
            state = torch.zeros(h, dk, dv, dtype=torch.float32, device=dev) if state is None else state.clone()
            for sh in seq:
                if sh.r == self.rank:
                    o, _ = mixer.run(inputs[sh.index], state)
                    out[torch.as_tensor(sh.rows, device=dev)] = o
                state = Affine.from_tensor(maps[sh.index], (h, dk, dk), (h, dk, dv)).apply(state)
            tail = self._before(seq, seq[-1].e, tail_in, halo, k1)
            for slot in (s.state_out, s.state_copy):
                if slot >= 0:
                    self.store.save(layer, slot, state, tail)
        return out

    def _run_alone(self, layer: int, mixer, seq: list[Shard], u: Tensor, side: tuple, out: Tensor) -> None:
        """One rank: the sequence's tokens in order from its state slot, into its state_out slot."""
        if not seq:
            return
        s = self.batch.seqs[seq[0].b]
        state, tail = self.store.load(layer, s.state_in)
        state = None if state is None else state.clone()
        rows = torch.as_tensor(np.concatenate([sh.rows for sh in seq]), device=u.device)
        conv, tail = mixer.conv(u[rows], tail)
        inp = mixer.inputs(conv, tuple(x[rows] for x in side))
        o, state = mixer.run(inp, state)
        out[rows] = o
        for slot in (s.state_out, s.state_copy):
            if slot >= 0:
                self.store.save(layer, slot, state, tail)

    def _before(self, seq: list[Shard], a: int, tail_in: Tensor, halo: Tensor, k1: int) -> Tensor:
        """The K-1 pre-conv rows before offset a of the sequence's new tokens: from the gathered shard ends (every
        one of those rows is among its shard's last K-1), the cached tail for offsets below 0."""
        rows = []
        for p in range(a - k1, a):
            if p < 0:
                rows.append(tail_in[k1 + p])
                continue
            sh = next(x for x in seq if x.a <= p < x.e)
            rows.append(halo[sh.index, k1 - (sh.e - p)])
        return torch.stack(rows) if rows else tail_in[:0]

    def _all_reduce(self, t: Tensor) -> None:
        import time

        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self.exchange_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- a rank without tokens
    def replicate(self, model: nn.Module) -> None:
        """Take part in every recurrent layer's exchanges and advance the replicas, with no token of its own."""
        for layer in model.model.layers:
            if getattr(layer, "recurrent", False):
                self(layer.linear_attn.layer_idx, layer.linear_attn, None, None)
