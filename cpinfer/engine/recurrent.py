"""The rank side of the recurrent layers (hybrid families): one `RecurrentFn` per forward that runs every recurrent
layer's conv and recurrence for the batch's sequences from their state slots, exact under any CP sharding.

Per recurrent layer, with N > 1 CP ranks (mixer-agnostic: any mixer with the staged shape of
`model/recurrent/__init__.py`: `conv`, `inputs`, `run`, `summary`, `kernel`, `conv_channels`, `state_shape`, and
optionally `side_shapes` / `side_fp32`, the per-token shapes of its side inputs and which are fp32, and `map_shape`,
the shape of its maps' M: (H, Dk, Dk) by default, (H,) for Mamba-2's decay per head):

1. row exchange: the shards (runs of consecutive new tokens of one sequence on one rank; the same list on every
   rank, derived from the batch) publish rows in one all-reduce of a zero-padded buffer. A short shard (one whose
   pre-conv rows and side inputs take fewer bytes than its affine map: a decode token, a verify run) ships all of
   them, and every rank runs it itself; a long one ships its last kernel - 1 pre-conv rows. Every row a shard's
   conv needs before its first token is among those, or in the sequence's cached tail (the state slot's).
2. each rank convolves its long shards, computes their recurrence inputs and their affine maps (`summary`; with a
   mixer's `summary_with_outputs`, in the same pass the outputs as a function of the starting state, finished by
   `outputs_from` in step 4 instead of a second run). A sequence's first shard starts from the slot's state, known
   already: it runs plainly (its outputs final) and ships its end state as a constant map (M = 0), about half the
   work of a map. That end state also goes straight to the owner of the sequence's second shard (a relay, one
   point-to-point message as soon as it is known), which runs that shard's first len(first shard) tokens plainly
   from it once its other work is done (its tail, if any, as a map with outputs first: the wait hides behind it)
   and ships the second shard's end state as a constant map too. At CP2 the ring layout puts chunks 0 and 3 on
   rank 0 and chunks 1-2 on rank 1: each rank now runs one chunk plainly and one as a map, where rank 1 ran two
   maps before;
3. map exchange: one all-reduce of the long shards' [|M| + |B|] fp32 maps (fixed size per shard, independent of
   its length; |B| alone for a constant map); none when every shard is short (decode).
4. every rank goes through each sequence's shards in order from its state_in slot: a short shard is run, a long
   one's map applied (after running it from that starting state where it is this rank's); the final state and the
   new conv tail go into the state_out slot (and state_copy, a snapshot) of its replica. A rank with no token in
   the forward still takes part (`replicate`), so every rank keeps every state.

With one rank the shards run one after the other from the state slot (no summary, no exchange).

A verify sequence (speculative decoding: [last, d_1 .. d_k], `SeqInput.draft`) runs token by token, as plain decode
would, on every rank (its shards always ship their rows), and every replica keeps the state and tail after each of
its tokens (`StateStore.keep`): when drafts are rejected, the next forward rolls the slot back to the state after
the last accepted token (`StateStore.apply_picks`), exactly as if the rejected tokens had never run.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from cpinfer.engine.batch import ForwardBatch
from cpinfer.engine.kv.state_store import StateStore
from cpinfer.model.recurrent.affine import Affine, compose


class ExchangeTimer:
    """Opt-in timing of this rank's recurrent exchanges (`cpinfer bench prefill`; set `EXCHANGE_TIMER` on every
    rank): a barrier before each all-reduce tells the wait for the slowest rank (`wait_s`) apart from the exchange
    itself (`exchange_s`); `bytes` and `calls` count what was all-reduced. Off by default."""

    def __init__(self):
        self.wait_s = self.exchange_s = 0.0
        self.bytes = self.calls = 0
        self.relays = 0  # relayed states received (`RecurrentRunner`: a sequence's state after its first shard)

    def all_reduce(self, t: Tensor, group) -> float:
        """All-reduce t over `group`, timed; the exchange's seconds."""
        sync = torch.cuda.synchronize if t.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        dist.barrier(group=group)
        t1 = time.perf_counter()
        dist.all_reduce(t, group=group)
        sync()
        t2 = time.perf_counter()
        self.wait_s += t1 - t0
        self.exchange_s += t2 - t1
        self.bytes += t.numel() * t.element_size()
        self.calls += 1
        return t2 - t1

    def to_dict(self) -> dict:
        return {"wait_s": self.wait_s, "exchange_s": self.exchange_s, "bytes": self.bytes, "calls": self.calls,
                "relays": self.relays}

    def relayed(self, t: Tensor, waited_s: float) -> None:
        """A relayed state received after waiting `waited_s` for it (counted as a wait for another rank)."""
        self.wait_s += waited_s
        self.bytes += t.numel() * t.element_size()
        self.relays += 1


EXCHANGE_TIMER: ExchangeTimer | None = None  # this rank's timer when a benchmark switched it on
_RELAY_TAG = 0x5E1A  # the relayed states' point-to-point messages (in sequence order between a pair of ranks)


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
        self.exchange_s = 0.0  # seconds in the exchanges when an `ExchangeTimer` is on (benchmarks), else 0

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
        # 1. rows to everyone: a short shard's every pre-conv row and side inputs (cheaper than its map: every rank
        # then runs it itself), a long one's last K-1 pre-conv rows (the conv halo of whatever follows it)
        c = mixer.conv_channels
        shapes = getattr(mixer, "side_shapes", None)  # per-token shapes of the side inputs (None: maps only)
        widths = [] if shapes is None else [int(np.prod(x)) for x in shapes]
        fp32 = getattr(mixer, "side_fp32", None) or (False,) * len(widths)  # sides kept in fp32 (shipped so)
        side_dtypes = [torch.float32 if f else dtype for f in fp32]
        ship = torch.float32 if any(fp32) else dtype  # the rows' buffer (the compute dtype's rows cast back exactly)
        m_shape = tuple(getattr(mixer, "map_shape", (h, dk, dk)))  # M: a matrix per head, or a decay (Mamba-2)
        m_size, b_size = int(np.prod(m_shape)), h * dk * dv
        per_row = (c + sum(widths)) * torch.finfo(ship).bits // 8
        layout, n_rows, n_maps = {}, 0, 0  # shard index -> (raw, first row, rows, map index)
        for seq in self.seqs:
            verify = self._verify(seq)
            if verify and shapes is None:
                raise ValueError(f"{type(mixer).__name__} gives no side_shapes: its verify rows cannot run on every "
                                 "rank (speculative decoding under CP)")
            for sh in seq:
                t = sh.e - sh.a
                raw = shapes is not None and (verify or t * per_row <= (m_size + b_size) * 4)
                rows = t if raw else k1
                layout[sh.index] = (raw, n_rows, rows, -1 if raw else n_maps)
                n_rows += rows
                n_maps += not raw
        buf = torch.zeros(n_rows, c + sum(widths), dtype=ship, device=dev)
        for seq in self.seqs:
            for sh in seq:
                if sh.r != self.rank:
                    continue
                raw, at, rows, _ = layout[sh.index]
                idx = torch.as_tensor(sh.rows[-rows:], device=dev)
                buf[at + rows - len(idx):at + rows, :c] = u[idx]
                if raw:
                    buf[at:at + rows, c:] = torch.cat([x[idx].reshape(len(idx), -1) for x in side], dim=1)
        self._all_reduce(buf)
        halo = (buf, layout)
        # 2. conv, inputs: my long shards (and their maps), every short shard (on every rank)
        relays = self._relays(layout)  # a sequence's second shard -> its first, when both are long
        # where each long shard's map lies in the exchanged buffer: a constant map (a first or a relayed shard's:
        # its end state, known in step 2) ships B only
        spans, at = [], 0  # map index -> (its slice of the buffer, constant)
        for seq in self.seqs:
            for sh in seq:
                if not layout[sh.index][0]:
                    const = sh.a == 0 or sh.index in relays
                    spans.append((slice(at, at + (b_size if const else m_size + b_size)), const))
                    at = spans[-1][0].stop
        maps = torch.zeros(at, dtype=torch.float32, device=dev)
        deferred = hasattr(mixer, "summary_with_outputs")  # else: summary, then a run from the starting state
        inputs, done = {}, {}  # done: outputs final in step 2 (a first shard's, a relayed shard's)
        recvs = {i: self._recv((h, dk, dv), first.r, dev) for i, (first, second) in relays.items()
                 if second.r == self.rank}
        sends, later = [], []  # sends: in flight until step 2 ends; later: relayed shards, run last
        for seq in self.seqs:
            state_in, tail_in = self.store.load(layer, self.batch.seqs[seq[0].b].state_in)
            for sh in seq:
                raw, at, rows, m = layout[sh.index]
                if raw:
                    part = buf[at:at + rows]
                    sides = torch.split(part[:, c:], widths, dim=1)
                    side_rows = tuple(x.reshape(rows, *shape).to(d)
                                      for x, shape, d in zip(sides, shapes, side_dtypes))
                    conv, _ = mixer.conv(part[:, :c].to(dtype), self._before(seq, sh.a, tail_in, halo, k1))
                    inputs[sh.index] = mixer.inputs(conv, side_rows)
                elif sh.r == self.rank:
                    idx = torch.as_tensor(sh.rows, device=dev)
                    conv, _ = mixer.conv(u[idx], self._before(seq, sh.a, tail_in, halo, k1))
                    inp = mixer.inputs(conv, tuple(x[idx] for x in side))
                    if sh.a == 0:  # its starting state is known: a plain run, its end state shipped as a constant map
                        done[sh.index], end = mixer.run(inp, None if state_in is None else state_in.clone())
                        maps[spans[m][0]] = end.reshape(-1)
                        if len(seq) > 1 and seq[1].index in relays:  # and relayed to the second shard's owner
                            sends.append(self._send(end, seq[1].r))
                        continue
                    if sh.index in relays:  # its head waits for the relayed state: its tail's map first
                        head = min(len(sh.rows), relays[sh.index][0].e)
                        tail = mixer.summary_with_outputs(inp[head:]) if deferred and head < len(sh.rows) else None
                        later.append((sh, m, inp, head, tail))
                        continue
                    if deferred:  # the map and the outputs as a function of the starting state, in one pass
                        amap, *inputs[sh.index] = mixer.summary_with_outputs(inp)
                    else:
                        amap, inputs[sh.index] = mixer.summary(inp), inp
                    maps[spans[m][0]] = amap.to_tensor()
        for sh, m, inp, head, tail in later:  # from the relayed state: the head plainly, then the tail's map
            state = self._wait(recvs[sh.index])
            if tail is None:  # all of it plainly (a mixer without outputs as a function of the state: a rerun)
                done[sh.index], state = mixer.run(inp, state)
            else:
                o, state = mixer.run(inp[:head], state)
                amap, o0, om = tail
                done[sh.index] = torch.cat((o, mixer.outputs_from(o0, om, state)))
                state = amap.apply(state)
            maps[spans[m][0]] = state.reshape(-1)
        for work in sends:
            work.wait()
        # 3. every long shard's map, to everyone (no exchange when every shard is short: decode)
        if n_maps:
            self._all_reduce(maps)
        # 4. starting states, my outputs, every sequence's final state and tail
        for seq in self.seqs:
            s = self.batch.seqs[seq[0].b]
            state, tail_in = self.store.load(layer, s.state_in)
            state = torch.zeros(h, dk, dv, dtype=torch.float32, device=dev) if state is None else state.clone()
            kept = [] if self._verify(seq) else None  # a verify run: the state and tail after each token
            for sh in seq:
                raw, _, _, m = layout[sh.index]
                if raw:
                    if kept is not None:
                        o, state = self._run_kept(mixer, inputs[sh.index], state, kept,
                                                  lambda j, a=sh.a: self._before(seq, a + j + 1, tail_in, halo, k1))
                    else:
                        o, state = mixer.run(inputs[sh.index], state)
                    if sh.r == self.rank:
                        out[torch.as_tensor(sh.rows, device=dev)] = o
                    continue
                if sh.r == self.rank:  # (a first shard's outputs are final already)
                    o = done.get(sh.index)
                    if o is None:
                        o = mixer.outputs_from(*inputs[sh.index], state) if deferred else \
                            mixer.run(inputs[sh.index], state)[0]
                    out[torch.as_tensor(sh.rows, device=dev)] = o
                span, const = spans[m]
                state = maps[span].view(h, dk, dv).clone() if const else \
                    Affine.from_tensor(maps[span], m_shape, (h, dk, dv)).apply(state)
            tail = self._before(seq, seq[-1].e, tail_in, halo, k1)
            for slot in (s.state_out, s.state_copy):
                if slot >= 0:
                    self.store.save(layer, slot, state, tail)
            self._keep(layer, s.state_out, kept)
        return out

    def _verify(self, seq: list[Shard]) -> bool:
        """Whether the sequence is a verify run (speculative decoding), whose per-token states are kept."""
        if not seq:
            return False
        s = self.batch.seqs[seq[0].b]
        return s.draft is not None and len(s.draft) > 0 and s.state_out >= 0

    @staticmethod
    def _run_kept(mixer, inp, state: Tensor | None, kept: list, tail_after) -> tuple[Tensor, Tensor]:
        """A verify run token by token (as decode runs them): (o [T, H, Dv], final state), each token's state and
        the tail after it (`tail_after(j)`) appended to `kept`."""
        outs = []
        for j in range(len(inp)):
            o, state = mixer.run(inp[j:j + 1], state)
            outs.append(o)
            kept.append((state, tail_after(j)))
        return torch.cat(outs), state

    def _keep(self, layer: int, slot: int, kept: list | None) -> None:
        """Every token's state but the last (that one is in the slot) into the store, for a rollback."""
        if kept is None or len(kept) < 2:
            return
        self.store.keep(layer, slot, torch.stack([x[0] for x in kept[:-1]]), torch.stack([x[1] for x in kept[:-1]]))

    def _run_alone(self, layer: int, mixer, seq: list[Shard], u: Tensor, side: tuple, out: Tensor) -> None:
        """One rank: the sequence's tokens in order from its state slot, into its state_out slot."""
        if not seq:
            return
        s = self.batch.seqs[seq[0].b]
        state, tail = self.store.load(layer, s.state_in)
        state = None if state is None else state.clone()
        rows = torch.as_tensor(np.concatenate([sh.rows for sh in seq]), device=u.device)
        k1, tail_in = mixer.kernel - 1, tail
        conv, tail = mixer.conv(u[rows], tail)
        inp = mixer.inputs(conv, tuple(x[rows] for x in side))
        kept = None
        if self._verify(seq):
            kept, pre = [], torch.cat((tail_in.to(u.dtype), u[rows]))  # [K-1 + T, C] the pre-conv rows
            o, state = self._run_kept(mixer, inp, state, kept, lambda j: pre[j + 1:j + 1 + k1])
        else:
            o, state = mixer.run(inp, state)
        out[rows] = o
        for slot in (s.state_out, s.state_copy):
            if slot >= 0:
                self.store.save(layer, slot, state, tail)
        self._keep(layer, s.state_out, kept)

    def _before(self, seq: list[Shard], a: int, tail_in: Tensor, halo, k1: int) -> Tensor:
        """The K-1 pre-conv rows before offset a of the sequence's new tokens: from the gathered rows (a short
        shard's every row, a long one's last K-1: every row a conv needs before a shard is among them), the cached
        tail for offsets below 0."""
        buf, layout = halo
        rows = []
        for p in range(a - k1, a):
            if p < 0:
                rows.append(tail_in[k1 + p])
                continue
            sh = next(x for x in seq if x.a <= p < x.e)
            raw, at, n, _ = layout[sh.index]
            rows.append(buf[at + (p - sh.a) if raw else at + n - (sh.e - p), :tail_in.shape[1]].to(tail_in.dtype))
        return torch.stack(rows) if rows else tail_in[:0]

    def _relays(self, layout: dict) -> dict[int, tuple[Shard, Shard]]:
        """Sequences whose first and second shards are both long (maps, not rows): second shard's index -> (first,
        second). The first shard's end state is relayed to the second's owner (the module doc's step 2)."""
        out = {}
        for seq in self.seqs:
            if len(seq) > 1 and not layout[seq[0].index][0] and not layout[seq[1].index][0]:
                out[seq[1].index] = (seq[0], seq[1])
        return out

    def _send(self, state: Tensor, to: int):
        """Post the relay of a state to group rank `to` (gloo takes host tensors only); its work, to wait on."""
        t = (state.cpu() if dist.get_backend(self.group) == "gloo" else state).contiguous()
        return dist.isend(t, dist.get_global_rank(self.group, to), group=self.group, tag=_RELAY_TAG)

    def _recv(self, shape: tuple, src: int, dev) -> tuple:
        """Post the receive of a relayed state from group rank `src`: (work, buffer, device)."""
        host = dist.get_backend(self.group) == "gloo"
        t = torch.empty(shape, dtype=torch.float32, device="cpu" if host else dev)
        return dist.irecv(t, dist.get_global_rank(self.group, src), group=self.group, tag=_RELAY_TAG), t, dev

    @staticmethod
    def _wait(recv: tuple) -> Tensor:
        """The relayed state, once it is here (the wait timed when an `ExchangeTimer` is on)."""
        work, t, dev = recv
        t0 = time.perf_counter()
        work.wait()
        if EXCHANGE_TIMER is not None:
            EXCHANGE_TIMER.relayed(t, time.perf_counter() - t0)
        return t.to(dev)

    def _all_reduce(self, t: Tensor) -> None:
        timer = EXCHANGE_TIMER
        if timer is None:  # the default: no clock, no extra synchronisation
            dist.all_reduce(t, group=self.group)
            return
        self.exchange_s += timer.all_reduce(t, self.group)

    # ---------------------------------------------------------------- a rank without tokens
    def replicate(self, model: nn.Module) -> None:
        """Take part in every recurrent layer's exchanges and advance the replicas, with no token of its own."""
        for layer in model.model.layers:
            if getattr(layer, "recurrent", False):
                self(layer.linear_attn.layer_idx, layer.linear_attn, None, None)
