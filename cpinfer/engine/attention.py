"""CP attention for the engine's batches: the `cp_attention` visibility rule on the prefix tree, planned per forward.

A query of sequence b sees (1) every key of b's prefix-tree path before this forward's new tokens — slot runs the
KV manager gives per rank, all visible since their positions are smaller — and (2) b's new keys with
kv_pos <= q_pos (causal tiles from `build_items`). The plan is built once per forward from the batch alone (no
communication). Only sequences whose keys span ranks take part in the ring; the others are attended where they
live, and a forward without such a sequence issues no collective at all. Per layer only tensors move: pass-KV packs
each rank's visible store rows and new rows into one ring message (paper Alg. 2), pass-Q rotates queries and reads
the store in place, then returns partial outputs with one All2All (Alg. 3, 4).

Sliding-window and chunked layers get their own plans, once per forward per distinct (window, chunk) (one over the
ring's sequences, one over this rank's local ones): each rank gathers, per sequence, only the cached keys some query
can still see — positions > start - window, and >= the start of the chunk of the first new token, (start // C) * C
(`SlotPositions` mirrors every rank's slot positions from the batches) — plus the new ones, and runs windowed /
chunked `cp_attention` on them: tiles, ring steps and messages no query can see are skipped.

Attention sinks (one logit per head) are merged once per query, after the ring's partials and the local ones.

FP8 KV cache (`run(..., codecs=)`): K/V rows arrive as uint8 (e4m3 with a static scale per layer and KV head, or packed with a
scale per token and head, `kv/fp8.py`); `run` dequantizes the new rows and the store rows it reads with the layer's
codecs, and pass-KV ring messages carry the FP8 rows (dequantized per step).

MLA's expanded form (`run(..., expand=)`, `model/mla.py`): the store and the ring keep the latent; the rows a step
reads are up-projected to per-head K / V where they are read — each pass-KV ring block once when it arrives, the
store rows of my local and pass-Q steps once per layer (gathered: `held`), my new rows once — and the queries are
the ordinary per-head ones.

`prepare` plans every kind of layer the model has and puts every index the forward needs (model inputs, kernel
tables, message rows, gathers) into one `ForwardTables`, which the runner uploads once before layer 0.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.backends import get_step_backend, min_stair, resolve_name
from cpinfer.attention.cpu_kernels import decode_attention_op, flash_attention_op
from cpinfer.attention.kernels import cpu_flash_backend
from cpinfer.attention.items import FULL, MASK, AttnItem, mark_first, new_accumulator
from cpinfer.attention.kv_pack import pack_rows, row_width, unpack_rows, values_in_keys
from cpinfer.attention.local import build_items
from cpinfer.attention.merge import finish, merge_partials
from cpinfer.attention.step import HeadLayout
from cpinfer.attention.tables import ForwardTables
from cpinfer.cp.plan import CPAttentionPlan, plan_from_metadata
from cpinfer.cp.ring import ring_steps
from cpinfer.engine.batch import ForwardBatch
from cpinfer.engine.kv import fp8 as kv_fp8
from cpinfer.timing import Stopwatch


class SlotPositions:
    """The position of the token in every slot of every CP rank, [world, capacity] int64 (-1: never written).

    Every rank sees every `ForwardBatch`, so every rank keeps the same mirror (`record`), and windowed plans know
    the positions of cached keys on all ranks without communication. Within one of a sequence's slot runs the
    positions increase (the KV manager appends a segment's tokens in position order into consecutive slots), and
    runs are listed in position order, so the keys still inside a window are found by binary search.
    """

    def __init__(self, world: int, capacity: int):
        self.pos = np.full((world, capacity), -1, dtype=np.int64)

    def record(self, batch: ForwardBatch) -> None:
        for s in batch.seqs:
            self.pos[s.ranks, s.slots] = s.start + np.arange(len(s.slots), dtype=np.int64)

    def recent_runs(self, rank: int, runs: np.ndarray, first_pos: int) -> np.ndarray:
        """The runs ([R, 2], position order) on `rank` cut to the slots holding positions >= first_pos ([R', 2])."""
        if not len(runs):
            return np.zeros((0, 2), dtype=np.int64)
        last = self.pos[rank, runs[:, 1] - 1]  # the newest position of each run
        runs = np.array(runs[np.searchsorted(last, first_pos, side="left"):], dtype=np.int64)
        if len(runs):
            runs[0, 0] += int(np.searchsorted(self.pos[rank, runs[0, 0]:runs[0, 1]], first_pos, side="left"))
        return runs

    def recent(self, rank: int, runs: np.ndarray, first_pos: int) -> np.ndarray:
        """Slots of `runs` ([R, 2], position order) on `rank` holding positions >= first_pos, in order."""
        if not len(runs):
            return np.zeros(0, dtype=np.int64)
        last = self.pos[rank, runs[:, 1] - 1]  # the newest position of each run
        runs = runs[np.searchsorted(last, first_pos, side="left"):]
        if not len(runs):
            return np.zeros(0, dtype=np.int64)
        a0 = int(runs[0, 0])
        a0 += int(np.searchsorted(self.pos[rank, a0:runs[0, 1]], first_pos, side="left"))
        parts = [np.arange(a0, runs[0, 1], dtype=np.int64)] + [np.arange(a, e, dtype=np.int64) for a, e in runs[1:]]
        return np.concatenate(parts)


def _merge_runs(runs: np.ndarray) -> np.ndarray:
    """[R, 2] slot runs → the same keys with touching runs joined."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    if len(runs) < 2:
        return runs
    opens = np.ones(len(runs), dtype=bool)
    opens[1:] = runs[1:, 0] != runs[:-1, 1]
    first = np.nonzero(opens)[0]
    last = np.append(first[1:] - 1, len(runs) - 1)
    return np.stack((runs[first, 0], runs[last, 1]), axis=1)


def _shift(items: list[AttnItem], dq: int, dk: int) -> list[AttnItem]:
    return [dataclasses.replace(it, q0=it.q0 + dq, q1=it.q1 + dq, k0=it.k0 + dk, k1=it.k1 + dk) for it in items]


def first_visible(start: int, window: int | None, chunk: int | None) -> int:
    """The first position a query at position >= `start` can see under a window and / or a chunk."""
    first = 0 if window is None else start - window + 1
    return first if chunk is None else max(first, start // chunk * chunk)


def ring_members(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """(sequences in the ring, sequences attended where they live): a sequence takes part in the ring when its keys
    (cached and new) sit on more than one rank — the KV manager's `spread` — else no other rank needs its tokens."""
    ring = [b for b, s in enumerate(batch.seqs) if s.spread]
    return ring, [b for b, s in enumerate(batch.seqs) if not s.spread]


def _causal_items(q_pos: np.ndarray, k_pos: np.ndarray, q0: int, k0: int, stair: int) -> list[AttnItem]:
    """Queries of one sequence against new keys of the same sequence (kv_pos <= q_pos), offsets applied."""
    zq, zk = np.zeros(len(q_pos), dtype=np.int64), np.zeros(len(k_pos), dtype=np.int64)
    return _shift(build_items(zq, q_pos, zk, k_pos, min_stair=stair), q0, k0)


class BatchAttention:
    """One rank's attention plan for a forward; `run` is called once per layer."""

    def __init__(self, batch: ForwardBatch, rank: int, world: int, group, backend: str | None = None,
                 device=torch.device("cpu"), slot_positions: SlotPositions | None = None):
        self.rank, self.world, self.group = rank, world, group
        self.strategy = batch.strategy
        seqs = batch.seqs
        self.ring, local = ring_members(batch) if world > 1 else ([], list(range(len(seqs))))
        self.local = [b for b in local if seqs[b].ranks[0] == rank]  # a local sequence's tokens are all on one rank
        self.idle = not self.ring and not self.local  # nothing to compute and no ring to serve: skip the forward
        if self.idle:
            return
        name = resolve_name(backend, device)  # "auto" / $CPINFER_ATTENTION_BACKEND → a concrete backend
        self.backend_name, self.device = name, device
        self.backend = get_step_backend(name, device)
        self.stair = min_stair(name)
        self.batch, self.slot_positions = batch, slot_positions
        self._windowed: dict[tuple, list] = {}  # (window, chunk) -> [(plan, my rows)]: the ring's, then my local ones'
        self.tables = ForwardTables(device)  # every device index of the forward, uploaded once (`prepare`)
        self.prepared = False
        self.store_rows: int | None = None  # set by `prepare` for backends that read a step in one call
        self.both: dict = {}  # step ("local" or j) -> its store and new-key items as one list (`_one_source`)
        empty = np.zeros(0, dtype=np.int64)
        self.idx = [[empty] * len(seqs) for _ in range(world)]  # new tokens of b on rank r (ring and mine)
        for b in self.ring:
            for r in range(world):
                self.idx[r][b] = np.nonzero(seqs[b].ranks == r)[0]
        for b in self.local:
            self.idx[rank][b] = np.arange(len(seqs[b].token_ids), dtype=np.int64)
        counts = np.asarray([[len(x) for x in row] for row in self.idx], dtype=np.int64).reshape(world, len(seqs))
        self.counts = counts
        order = self.ring + self.local  # rows on every rank: the ring's sequences first, then my local ones
        self.qoff = np.zeros((world, len(seqs)), dtype=np.int64)  # first row of b's new tokens on rank r
        self.qoff[:, order] = np.cumsum(counts[:, order], axis=1) - counts[:, order]
        self.nq = counts.sum(axis=1)  # [world] rows per rank
        self.nq_ring = counts[:, self.ring].sum(axis=1)  # [world] of which in the ring
        self.max_q = int(self.nq_ring.max())
        mine = [self.idx[rank][b] for b in order]
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
        self.input_ids = cat([seqs[b].token_ids[i] for b, i in zip(order, mine)])  # [Lq] this rank's new tokens
        self.positions = cat([seqs[b].start + i for b, i in zip(order, mine)])
        self.slots = cat([seqs[b].slots[i] for b, i in zip(order, mine)])
        # positions of b's new tokens on rank r, for what this rank's plans read: the ring's sequences on every
        # rank, my local ones on mine
        self.pos: list[list] = [[None] * len(seqs) for _ in range(world)]
        for b, r in self._members():
            self.pos[r][b] = seqs[b].start + self.idx[r][b]
        self.steps: list | None = None  # the full-attention plan: built on first use (never if every layer slides)
        self.values_in_keys = False  # the store's v is its k's first channels (MLA): messages carry keys alone
        self.direct: list | None = None  # host decode's rows and their store runs (`_direct_rows`), or None
        self.one_run: tuple | None = None  # CPU prefill's one kernel call per local sequence (`_one_run_calls`)
        self._direct_tables = None  # `_plan_batched_direct`'s (op, runs, first), False when it does not apply
        self.expanded = False  # MLA's expanded form this forward (`prepare`)
        self.held = np.zeros(0, dtype=np.int64)  # expanded form: the store slots my local / pass-Q steps read

    def _members(self) -> list[tuple[int, int]]:
        """(sequence, rank) pairs this rank's plans read: the ring's sequences on every rank, mine on mine."""
        return [(b, r) for b in self.ring for r in range(self.world)] + [(b, self.rank) for b in self.local]

    def _plan_full(self) -> None:
        seqs = self.batch.seqs
        # keys every query of b sees in full on rank r: the cached runs, plus b's single new token (decode)
        self.full_runs: list[list] = [[None] * len(seqs) for _ in range(self.world)]
        for b, r in self._members():
            self.full_runs[r][b] = self._visible_runs(seqs[b], r)
        self.steps = []
        if self.ring and self.strategy == "pass-kv":
            self._plan_pass_kv(seqs)
        elif self.ring:
            self._plan_pass_q(seqs)
        self._plan_local(seqs)
        if self.expanded:
            self._hold_store()

    def _hold_store(self) -> None:
        """Expanded form: the store rows my local and pass-Q steps read become `held` (sorted slots, gathered and
        up-projected once per layer), their items re-pointed at rows of that gather; no host decode path."""
        pairs = [self.local_steps] + (list(self.steps) if self.ring and self.strategy != "pass-kv" else [])
        runs = [(it.k0, it.k1) for store_items, _ in pairs for it in store_items]
        parts = [np.arange(a, e, dtype=np.int64) for a, e in runs]
        held = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

        def moved(items):  # a run [k0, k1) of slots -> the same keys' rows in the gather (a run there too)
            starts = np.searchsorted(held, [it.k0 for it in items]).tolist()
            return [dataclasses.replace(it, k0=a, k1=a + it.k1 - it.k0) for it, a in zip(items, starts)]

        self.local_steps = (moved(self.local_steps[0]), self.local_steps[1])
        if self.ring and self.strategy != "pass-kv":
            self.steps = [(moved(store_items), new_items) for store_items, new_items in self.steps]
        self.held, self.direct = held, None

    @staticmethod
    def _visible_runs(s, r: int) -> np.ndarray:
        runs = s.ctx_runs[r]
        if len(s.token_ids) == 1 and s.ranks[0] == r:
            runs = np.concatenate((runs, [[s.slots[0], s.slots[0] + 1]])).astype(np.int64)
        return _merge_runs(runs)

    # ------------------------------------------------------------------ planning
    def _plan_pass_kv(self, seqs) -> None:
        """steps[j]: my queries against the packed message of source (rank - j): [store rows U_s ; new rows of s]."""
        me, n = self.rank, self.world
        self.send_slots = []
        for s in range(n):
            parts = [np.arange(a, e, dtype=np.int64) for b in self.ring for a, e in self.full_runs[s][b]]
            self.send_slots.append(np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64))
        self.max_send = max(len(u) + int(c) for u, c in zip(self.send_slots, self.nq_ring))
        covered = np.zeros(int(self.nq_ring[me]), dtype=bool)
        for j in range(n):
            src = (me - j) % n
            items: list[AttnItem] = []
            u = self.send_slots[src]
            for b in self.ring:
                s = seqs[b]
                nqb = int(self.counts[me, b])
                if nqb == 0:
                    continue
                q0 = int(self.qoff[me, b])
                runs = self.full_runs[src][b]
                if len(runs):
                    starts = np.searchsorted(u, runs[:, 0])
                    packed = _merge_runs(np.stack((starts, starts + runs[:, 1] - runs[:, 0]), axis=1))
                    items += [AttnItem(q0, q0 + nqb, int(a), int(e), FULL) for a, e in packed]
                if len(s.token_ids) > 1 and self.counts[src, b]:
                    items += _causal_items(self.pos[me][b], self.pos[src][b], q0, len(u) + int(self.qoff[src, b]),
                                           self.stair)
            self.steps.append(mark_first(items, len(covered), covered))

    def _plan_pass_q(self, seqs) -> None:
        """steps[j] = (items against my store, items against my new K/V) for the queries of source (rank - j)."""
        me, n = self.rank, self.world
        for j in range(n):
            src = (me - j) % n
            store_items: list[AttnItem] = []
            new_items: list[AttnItem] = []
            for b in self.ring:
                s = seqs[b]
                nqb = int(self.counts[src, b])
                if nqb == 0:
                    continue
                q0 = int(self.qoff[src, b])
                store_items += [AttnItem(q0, q0 + nqb, int(a), int(e), FULL) for a, e in self.full_runs[me][b]]
                if len(s.token_ids) > 1 and self.counts[me, b]:
                    new_items += _causal_items(self.pos[src][b], self.pos[me][b], q0, int(self.qoff[me, b]),
                                               self.stair)
            covered = np.zeros(int(self.nq_ring[src]), dtype=bool)
            self.steps.append((mark_first(store_items, len(covered), covered),
                               mark_first(new_items, len(covered), covered)))

    def _plan_local(self, seqs) -> None:
        """My local sequences: their queries against their keys, all on this rank (store runs, then new K/V)."""
        me, store_items, new_items = self.rank, [], []
        for b in self.local:
            s, q0 = seqs[b], int(self.qoff[me, b])
            nqb = int(self.counts[me, b])
            store_items += [AttnItem(q0, q0 + nqb, int(a), int(e), FULL) for a, e in self.full_runs[me][b]]
            if len(s.token_ids) > 1:
                new_items += _causal_items(self.pos[me][b], self.pos[me][b], q0, q0, self.stair)
        covered = np.zeros(int(self.nq[me]), dtype=bool)
        self.local_steps = (mark_first(store_items, len(covered), covered),
                            mark_first(new_items, len(covered), covered))
        self.direct = self._direct_rows(store_items, new_items)
        self.one_run = None if self.direct is not None else self._one_run_calls(seqs)

    def _one_run_calls(self, seqs) -> tuple | None:
        """CPU prefill through our kernels: each local sequence's queries against all of its keys in one flash call
        when they are one run of store slots — its cached keys, then its new rows (in the store by the time attention
        runs: the layer writes them first) — the new rows' causality a causal offset (the cached keys' count); the
        decode rows among them (one token, its keys in any runs) in one call of the batched decode kernel. No
        accumulator, no merge of a cached part and a new part. ([(q0, q1, k0, k1, offset)], decode rows or None) or
        None (a ring, a sequence whose keys are split over runs, another backend: the item plan runs)."""
        if self.ring or self.device.type != "cpu" or getattr(self.backend, "kernel", None) is not cpu_flash_backend:
            return None
        calls, rows, runs_of = [], [], []
        for b in self.local:
            q0, n = int(self.qoff[self.rank, b]), int(self.counts[self.rank, b])
            runs, new = self.full_runs[self.rank][b], self.slots[q0:q0 + n]
            if len(seqs[b].token_ids) == 1:  # a decode row: its key is in its runs, all visible
                rows.append(q0)
                runs_of.append(np.asarray(runs, dtype=np.int64).reshape(-1, 2))
                continue
            start = int(new[0])
            if len(runs) > 1 or (len(runs) == 1 and int(runs[0][1]) != start) or \
                    not np.array_equal(new, np.arange(start, start + n)):
                return None
            k0 = int(runs[0][0]) if len(runs) else start
            calls.append((q0, q0 + n, k0, start + n, start - k0))
        decode = None
        if rows:  # (rows [N], runs [R, 2], first [N + 1]) as the decode kernel reads them
            first = np.concatenate(([0], np.cumsum([len(r) for r in runs_of])))
            decode = tuple(torch.from_numpy(a.astype(np.int64)) for a in (np.asarray(rows), np.concatenate(runs_of),
                                                                           first))
        return calls, decode

    def _direct_rows(self, store_items: list[AttnItem], new_items: list[AttnItem]) -> list | None:
        """Decode on the host with a per-item kernel (cpu-flash): no ring, one new token per local sequence, its
        keys all in store runs. Then [(row, [(k0, k1), ...])] per query row: `_run_direct` calls the kernel on each
        run and merges the few partials itself, with no accumulator, merge of empty rows or copy; else None."""
        if self.ring or new_items or self.device.type != "cpu" or not hasattr(self.backend, "kernel"):
            return None
        rows: dict[int, list] = {}
        for it in store_items:
            if it.q1 - it.q0 != 1 or it.kind != FULL:
                return None
            rows.setdefault(it.q0, []).append((it.k0, it.k1))
        return sorted(rows.items()) if len(rows) == int(self.nq[self.rank]) else None

    def prepare(self, layout: HeadLayout, windows, store_rows: int | None = None, chunks=None,
                values_in_keys: bool = False, expanded: bool = False) -> ForwardTables:
        """Plan every kind of layer the model has (`windows`, `chunks`: each layer's window and attention chunk,
        None = none; both None = full attention) and put every device index the forward reads into `self.tables`:
        the model's inputs ("input_ids", "positions", "slots"), the kernel tables of every ring step and of my
        local sequences, the rows each message packs and the windowed / chunked gathers. The caller uploads them
        once, before layer 0; inside the layers nothing else crosses to the device. `store_rows`: the store's
        size; with it a backend that addresses keys through an index (flash-attn) reads a step's store rows and
        new rows (already written to the store) in one call. `values_in_keys`: the store's v is the view of its k's
        first channels (MLA). `expanded`: MLA's expanded form (`layout` then that of the per-head K / V): the store
        rows are read through `held`, not in place."""
        t = self.tables
        self.values_in_keys, self.expanded = values_in_keys, expanded
        self.store_rows = store_rows if self.backend.maps_keys(layout) and not expanded else None
        for name in ("input_ids", "positions", "slots"):
            t.put((name,), getattr(self, name).astype(np.int64, copy=False))  # [Lq] each
        kinds = set(zip(windows, chunks if chunks is not None else [None] * len(windows)))
        if expanded and kinds != {(None, None)}:
            raise ValueError("MLA's expanded form runs full attention only (this model has windowed / chunked layers)")
        if (None, None) in kinds:
            self._plan_full()
            self._prepare_full(layout)
            if self.direct is not None and layout is not None:
                self._plan_batched_direct(layout.dtype)
        for kind in sorted(kinds - {(None, None)}, key=lambda wc: (wc[0] or 0, wc[1] or 0)):
            self._window_plans(kind, layout)
        self.prepared = True
        return t

    def _prepare_full(self, layout: HeadLayout) -> None:
        for j, step in enumerate(self.steps):
            if isinstance(step, tuple):
                self._prepare_pair(j, step, layout)
            else:
                self.backend.prepare_items(step, None, self.tables, ("full", "kv", j), layout)
        self._prepare_pair("local", self.local_steps, layout)
        if self.ring and self.strategy == "pass-kv":
            self.tables.put(("full", "send"), self.send_slots[self.rank])
        if self.expanded:
            self.tables.put(("full", "held"), self.held)

    def _prepare_pair(self, j, step, layout: HeadLayout) -> None:
        """The tables of a (store items, new-key items) step: one call over both when the backend maps keys."""
        if self.store_rows is not None and not any(it.kind == MASK for it in step[1]):
            self.both[j] = self._one_source(step)  # one call: the new keys read from the store
            self.backend.prepare_items(self.both[j], None, self.tables, ("full", "both", j), layout,
                                       key_map=self._store_row_of)
        else:
            self.backend.prepare_items(step[0], None, self.tables, ("full", "store", j), layout)
            self.backend.prepare_items(step[1], None, self.tables, ("full", "new", j), layout)

    def _one_source(self, step) -> list[AttnItem]:
        """A pass-Q / local step's store items and new-key items as one list over [store rows ; my new rows]."""
        store_items, new_items = step
        return list(store_items) + _shift(new_items, 0, self.store_rows)

    def _store_row_of(self, keys: np.ndarray) -> np.ndarray:
        """Key index of `_one_source` items → store row (my new tokens' K/V sit in their slots by then)."""
        new = keys >= self.store_rows
        return np.where(new, self.slots[np.where(new, keys - self.store_rows, 0)], keys)

    def _attend(self, j, step, q, k_new, v_new, store_k, store_v, acc_out, acc_lse, scale) -> None:
        """Step j ("local" or a pass-Q ring step): the queries `q` against my store and my new K/V, merged into
        (acc_out, acc_lse)."""
        if j in self.both:
            self.backend.attend_items(self.both[j], None, q, store_k, store_v, acc_out, acc_lse, scale, self.tables,
                                      ("full", "both", j))
            return
        store_items, new_items = step
        self.backend.attend_items(store_items, None, q, store_k, store_v, acc_out, acc_lse, scale, self.tables,
                                  ("full", "store", j))
        self.backend.attend_items(new_items, None, q, k_new, v_new, acc_out, acc_lse, scale, self.tables,
                                  ("full", "new", j))

    def _window_plans(self, kind: tuple, layout: HeadLayout) -> list[tuple[CPAttentionPlan, slice]]:
        """The windowed / chunked plans (once per forward and kind = (window, chunk)): the ring's sequences over
        every rank, my local ones on this rank alone; per rank, each sequence's keys some query can see — cached
        slots with positions >= `first_visible(start, window, chunk)`, then the new tokens' slots. Each with my
        rows; my gathered slots go to the tables under the plan's prefix + ("gather",)."""
        if kind in self._windowed:
            return self._windowed[kind]
        if self.slot_positions is None:
            raise RuntimeError("a sliding-window or chunked layer needs the runner's SlotPositions (a bug: none was "
                               "passed)")
        plans, lr = [], int(self.nq_ring[self.rank])
        if self.ring:
            plan = self._window_plan(kind, "ring", self.ring, list(range(self.world)), self.group, layout)
            plans.append((plan, slice(0, lr)))
        if self.local:
            plan = self._window_plan(kind, "local", self.local, [self.rank], None, layout)
            plans.append((plan, slice(lr, int(self.nq[self.rank]))))
        self._windowed[kind] = plans
        return plans

    def _window_plan(self, kind: tuple, part: str, members: list[int], ranks: list[int], group,
                     layout: HeadLayout) -> CPAttentionPlan:
        window, chunk = kind
        seqs, cat = self.batch.seqs, (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
        q_meta, kv_meta, mine = [], [], None
        for r in ranks:
            q_meta.append((cat([np.full(len(self.idx[r][b]), b, dtype=np.int64) for b in members]),
                           cat([self.pos[r][b] for b in members])))
            slots, seq_ids, pos = [], [], []
            for b in members:
                s = seqs[b]
                old = self.slot_positions.recent(r, s.ctx_runs[r], first_visible(s.start, window, chunk))
                new = s.slots[self.idx[r][b]]
                slots += [old, new]
                pos += [self.slot_positions.pos[r, old], self.pos[r][b]]
                seq_ids.append(np.full(len(old) + len(new), b, dtype=np.int64))
            kv_meta.append((cat(seq_ids), cat(pos)))
            if r == self.rank:
                mine = cat(slots)
        world, rank = len(ranks), ranks.index(self.rank)
        strategy = self.strategy if world > 1 else "pass-kv"
        plan = plan_from_metadata(q_meta, kv_meta, group=group, rank=rank, world=world, strategy=strategy,
                                  backend=self.backend_name, window=window, chunk=chunk,
                                  values_in_keys=self.values_in_keys)
        plan.table_prefix = ("win", window, chunk, part)
        plan.prepare(layout, self.device, self.tables)
        self.tables.put(plan.table_prefix + ("gather",), mine)  # [keys] my store slots the plan's K/V rows come from
        return plan

    # ------------------------------------------------------------------ per layer
    def run(self, q, k_new, v_new, store_k, store_v, scale: float, timings: list | None = None,
            window: int | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
            store_used: int | None = None, codecs: tuple | None = None, expand=None) -> torch.Tensor:
        """q [Lq, H, D], k_new [Lq, Hkv, D] / v_new [Lq, Hkv, Dv] (already written to the store), store_k / store_v
        [capacity, Hkv, D / Dv] (store_v may be the view store_k[..., :Dv]: MLA's latent; messages then carry keys
        alone) → out [Lq, H, Dv];
        `window` / `chunk`: the layer's sliding window / attention chunk (both None: full causal attention);
        `sinks` [H]: the layer's sink logits, merged once per query after every partial. Rows [0, nq_ring) belong
        to the ring's sequences, the rest to my local ones. `codecs` (an FP8 KV cache): the layer's (K, V)
        `kv_fp8.RowCodec`s, and the K/V tensors are their uint8 rows; `store_used`: the store rows ever written (those
        dequantized for steps that read the store). `expand` (MLA's expanded form, planned by `prepare`): latent rows
        [N, 1, D] -> (k [N, H, Dk], v [N, H, Dv]); q is then the per-head query [Lq, H, Dk], k_new / the store hold
        latents, and out is [Lq, H, Dv]."""
        packed = None
        if codecs is not None:  # attention reads the rows dequantized; pass-KV messages carry them as stored
            packed = (k_new, v_new, store_k, store_v)
            k_new, v_new, store_k, store_v = self._dequantize(q.dtype, packed, window, chunk, store_used, codecs)
        if not self.prepared:  # a caller that did not prepare: plan this layer's kind now (one more upload)
            self.prepare(HeadLayout.of(q, k_new), [window], chunks=[chunk],
                         values_in_keys=bool(values_in_keys(store_k, store_v)))  # (the store has rows: not None)
            self.tables.upload()
        if window is not None or chunk is not None:
            return self._run_windowed(q, store_k, store_v, scale, timings, (window, chunk), sinks)
        if self.steps is None:
            self._plan_full()
            self._prepare_full(HeadLayout.of(q, k_new))
        if self.direct is not None and sinks is None and packed is None:
            return self._run_direct(q, store_k, store_v, scale)
        if self.one_run is not None and sinks is None and packed is None and expand is None:
            out = self._run_one_run(q, store_k, store_v, scale)
            if out is not None:
                return out
        rows = (k_new, v_new, store_k, store_v)  # what pass-KV packs: the rows as stored (the latent when expanded)
        if expand is not None:  # my new rows and the store rows my steps read, up-projected once for this layer
            k_new, v_new = self._expand_new(k_new, expand)
            if self.local or (self.ring and self.strategy != "pass-kv"):
                store_k, store_v = expand(store_k.index_select(0, self.tables[("full", "held")]))
        acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], v_new.shape[-1], q.device)
        if self.local:
            self._attend("local", self.local_steps, q, k_new, v_new, store_k, store_v, acc_out, acc_lse, scale)
        if not self.ring:
            return finish(acc_out, acc_lse, sinks, q.dtype)
        lr = int(self.nq_ring[self.rank])
        dtype, q, k_new, v_new = q.dtype, q[:lr], k_new[:lr], v_new[:lr]
        if self.strategy == "pass-kv" and packed is not None:  # the message: packed store rows and new rows
            def decode(k, v):  # a received block's uint8 rows, dequantized as the store's are
                return kv_fp8.decode_rows(codecs, k, v, dtype, self.values_in_keys)

            self._run_pass_kv(q, packed[0][:lr], packed[1][:lr], packed[2], packed[3], scale, timings, acc_out,
                              acc_lse, decode, expand)
        elif self.strategy == "pass-kv":
            self._run_pass_kv(q, rows[0][:lr], rows[1][:lr], rows[2], rows[3], scale, timings, acc_out, acc_lse,
                              expand=expand)
        else:
            acc_out[:lr], acc_lse[:lr] = self._run_pass_q(q, k_new, v_new, store_k, store_v, scale, timings)
        return finish(acc_out, acc_lse, sinks, dtype)

    def _expand_new(self, k_new, expand) -> tuple[torch.Tensor, torch.Tensor]:
        """My new latent rows k_new [Lq, 1, D] up-projected -> (k [Lq, H, Dk], v [Lq, H, Dv]). Under pass-KV the ring's
        rows are up-projected from the message (step 0 is my own block), so only my local sequences' rows are here
        (the ring's rows of the result are left unset: no step reads them; none at all without local sequences)."""
        if not (self.ring and self.strategy == "pass-kv"):
            return expand(k_new)
        lr = int(self.nq_ring[self.rank])
        k, v = expand(k_new[lr:])  # [Lq - lr, H, Dk], [Lq - lr, H, Dv]
        if not self.local:
            return k, v  # (empty: the accumulator's width only)
        kx, vx = k.new_empty((k_new.shape[0],) + k.shape[1:]), v.new_empty((k_new.shape[0],) + v.shape[1:])
        kx[lr:], vx[lr:] = k, v
        return kx, vx

    def _run_direct(self, q, store_k, store_v, scale: float) -> torch.Tensor:
        """Host decode (`direct`): every query row against its store runs → out [Lq, H, Dv]. With aten's flash
        kernel (cpu-flash) in float32, one call of our batched kernel reads every row's runs in place
        (`cpu_kernels.py`, `_batched_direct`); else (no C++ compiler) one kernel call per run, a row's partials
        merged as `merge_into` does (every partial sees a key: no empty rows)."""
        batched = self._batched_direct(q, store_k, store_v)
        if batched is not None:
            op, runs, first = batched
            return op(q.contiguous(), store_k, store_v, runs, first, scale)
        kernel, outs = self.backend.kernel, []
        for row, runs in self.direct:
            qr = q[row:row + 1]  # [1, H, D]
            (a, e), rest = runs[0], runs[1:]
            out, lse = kernel(qr, store_k[a:e], store_v[a:e], False, None, scale)  # [1, H, Dv], [1, H]
            if rest:
                out = out.float()
            for i, (a, e) in enumerate(rest):
                o, l = kernel(qr, store_k[a:e], store_v[a:e], False, None, scale)
                out.lerp_(o.float(), torch.sigmoid(l - lse).unsqueeze(-1))  # out ← merge((out, lse), (o, l))
                if i + 1 < len(rest):
                    lse = torch.logaddexp(lse, l)
            outs.append(out.to(q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _run_one_run(self, q, store_k, store_v, scale: float) -> torch.Tensor | None:
        """`one_run`'s calls of our flash kernel (float32, the store's key width that of q, Dv a multiple of 16) ->
        out [Lq, H, Dv]; None where the kernel does not apply (the item plan then runs)."""
        op, calls, decode = flash_attention_op(), *self.one_run
        decode_op = decode_attention_op() if decode is not None else None
        if op is None or (decode is not None and decode_op is None) or q.dtype != torch.float32 or \
                store_k.dtype != torch.float32 or store_k.shape[-1] != q.shape[-1] or store_v.shape[-1] % 16:
            return None
        if decode is None and len(calls) == 1 and calls[0][:2] == (0, q.shape[0]):
            _, _, k0, k1, offset = calls[0]
            return op(q, store_k[k0:k1], store_v[k0:k1], True, scale, offset)[0]
        out = q.new_empty(q.shape[0], q.shape[1], store_v.shape[-1])
        for q0, q1, k0, k1, offset in calls:
            out[q0:q1] = op(q[q0:q1], store_k[k0:k1], store_v[k0:k1], True, scale, offset)[0]
        if decode is not None:
            rows, runs, first = decode
            out[rows] = decode_op(q.index_select(0, rows), store_k, store_v, runs, first, scale)
        return out

    def _plan_batched_direct(self, dtype: torch.dtype) -> None:
        """`_direct_tables`: (op, runs [R, 2], first [Lq + 1]) for one call of the batched CPU decode kernel over
        `direct`, or False: not aten's flash kernel (the user chose another), not float32, or no compiled kernel.
        Built by `prepare`, before layer 0 (no host work inside the layers)."""
        self._direct_tables = False
        ok = self.backend.kernel is cpu_flash_backend and dtype == torch.float32
        op = decode_attention_op() if ok else None
        if op is not None:
            runs = np.asarray([r for _, rs in self.direct for r in rs], dtype=np.int64).reshape(-1, 2)
            first = np.cumsum([0] + [len(rs) for _, rs in self.direct])
            self._direct_tables = (op, torch.as_tensor(runs), torch.as_tensor(first, dtype=torch.int64))

    def _batched_direct(self, q, store_k, store_v):
        """`_direct_tables` when this layer's tensors suit the kernel (float32 throughout, each row's channels
        contiguous), else None."""
        if self._direct_tables is None:  # a caller that prepared without a head layout: planned at layer 0
            self._plan_batched_direct(q.dtype)
        if not self._direct_tables or not q.dtype == store_k.dtype == store_v.dtype \
                or store_k.stride(-1) != 1 or store_v.stride(-1) != 1:
            return None
        return self._direct_tables

    def _dequantize(self, dtype, packed: tuple, window, chunk, used: int | None, codecs: tuple) -> tuple:
        """(k_new, v_new, store_k, store_v) of FP8 rows -> the same dequantized to `dtype` by the layer's (K, V)
        codecs; the store only rows [0, used), and not at all when no step of this layer reads it in place (a
        pass-KV-only forward)."""
        k_new, v_new, store_k, store_v = packed
        n = store_k.shape[0] if used is None else used
        reads_store = window is not None or chunk is not None or bool(self.local) or self.strategy != "pass-kv"
        shared = bool(values_in_keys(store_k, store_v))  # MLA: v stays k's first channels
        kn, vn = kv_fp8.decode_rows(codecs, k_new, v_new, dtype, shared)
        if not reads_store:
            return kn, vn, None, None
        return (kn, vn) + kv_fp8.decode_rows(codecs, store_k[:n], store_v[:n], dtype, shared)

    def _run_windowed(self, q, store_k, store_v, scale, timings, kind: tuple, sinks) -> torch.Tensor:
        if kind not in self._windowed:
            self._window_plans(kind, HeadLayout.of(q, store_k))
        out = q.new_empty(q.shape[:2] + store_v.shape[-1:])  # [Lq, H, Dv]
        for plan, rows in self._windowed[kind]:
            gather = self.tables[plan.table_prefix + ("gather",)]
            k = store_k.index_select(0, gather)
            v = k[..., :store_v.shape[-1]] if plan.values_in_keys else store_v.index_select(0, gather)
            out[rows] = plan.run(q[rows], k, v, timings, scale, sinks)
        return out

    def _run_pass_kv(self, q, k_new, v_new, store_k, store_v, scale, timings, acc_out, acc_lse, decode=None,
                     expand=None) -> None:
        """`decode`: FP8 KV, (k, v) -> dequantized (k, v): the rows packed here are uint8 and each received block is
        dequantized by it. `expand`: MLA's expanded form: the message carries latents, and each block
        (mine at step 0, then each received one) is up-projected once, for every head of this rank."""
        u = self.tables[("full", "send")]  # [U] my store rows in the message, uploaded before layer 0
        shared, dk, dv = self.values_in_keys, k_new.shape[-1], v_new.shape[-1]
        packed = k_new.new_zeros((self.max_send, k_new.shape[1], row_width(dk, dv, shared)))  # [max_send, Hkv, W]
        pack_rows(store_k, store_v, shared, packed, u)
        pack_rows(k_new, v_new, shared, packed[len(u):])

        def compute(j, block):
            k, v = unpack_rows(block, dk, dv)
            if decode is not None:
                k, v = decode(k, v)
            if expand is not None:
                k, v = expand(k)  # [max_send, 1, D] latent -> [max_send, H, Dk], [max_send, H, Dv]
            self.backend.attend_items(self.steps[j], None, q, k, v, acc_out, acc_lse, scale, self.tables,
                                      ("full", "kv", j))

        ring_steps(self.group, packed, self.world, compute, timings)

    def _run_pass_q(self, q, k_new, v_new, store_k, store_v, scale, timings):
        n, lq, h, d = self.world, q.shape[0], q.shape[1], v_new.shape[-1]
        rows = self.max_q
        partials = torch.zeros(n, rows, h, d + 1, dtype=torch.float32, device=q.device)  # out | lse per source
        partials[..., d].fill_(-torch.inf)
        cur = q
        if lq < rows:
            cur = q.new_zeros((rows, h, q.shape[2]))
            cur[:lq] = q

        def compute(j, block):
            part = partials[(self.rank - j) % n]
            self._attend(j, self.steps[j], block, k_new, v_new, store_k, store_v, part[..., :d], part[..., d], scale)

        ring_steps(self.group, cur, n, compute, timings)
        clock = Stopwatch(q.device)  # CUDA events on CUDA: the host does not wait for NCCL
        t0 = clock.mark()
        back = torch.empty_like(partials)
        dist.all_to_all_single(back, partials, group=self.group)  # back[s] = my queries' partial from rank s
        out, lse = merge_partials([back[s, :lq, :, :d] for s in range(n)], [back[s, :lq, :, d] for s in range(n)])
        if timings is not None:
            timings.append({"step": "all2all+merge", "compute_s": 0.0, "wait_s": clock.span(t0, clock.mark())})
        return out, lse  # fp32 [Lq, H, D], [Lq, H]
