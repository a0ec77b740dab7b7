"""A draft model under P/D (paper §4.3, with speculative decoding): the draft runs on the decode groups only, and its
K/V use the target's slots there (`spec_decode/draft_runner.py`). A handoff brings a prompt's target K/V, not the
draft's: the decode group recomputes the draft's rows of those positions, one draft-only prefill before the request
first drafts (`DraftRows`). The prefill group never loads the draft, and its prefix tree, tiers and moved-back
answers hold the target's K/V only.

Why recompute rather than send the draft's K/V with the target's: the prefill group would then run the draft on
every prompt too (mirrored forwards), keep the draft's rows of its whole prefix tree (tiers, moved-back answers
included) and send twice the messages; a draft is small (a layer or a few), so its prefill on the decode group
costs a fraction of the target's prompt, paid once per handoff (docs/engine.md, "Prefill and decode groups")."""
from __future__ import annotations

import numpy as np

from cpinfer.engine.batch import ForwardBatch, SeqInput
from cpinfer.engine.pd.paths import path_layout
from cpinfer.engine.request import Request

FILL_CHUNK = 512  # tokens of one request per draft-only prefill forward


class DraftRows:
    """Per decode group with a draft: [decode CP, slots + 1] bool, whether the slot's row is in the draft's store
    (False: its target row arrived by a handoff, the draft's is not computed yet)."""

    def __init__(self, decode_groups: list, decode_cp: int):
        self.cp = decode_cp
        self.groups = {i: g for i, g in enumerate(decode_groups, start=1) if getattr(g, "draft", None) is not None}
        self.ok: dict[int, np.ndarray] = {}
        for i, g in self.groups.items():
            g.draft_rows = lambda i=i: self._ok(i)

    def tracks(self, i: int) -> bool:
        return i in self.groups

    def _ok(self, i: int) -> np.ndarray:
        """Group i's array, (re)made at its KV manager's capacity (sized once its ranks measured)."""
        shape = (self.cp, self.groups[i].kv.capacity_per_rank + 1)
        if i not in self.ok or self.ok[i].shape != shape:
            self.ok[i] = np.ones(shape, dtype=bool)
        return self.ok[i]

    def received(self, i: int, ranks: np.ndarray, slots: np.ndarray) -> None:
        """A handoff's target rows go to these slots of group i: the draft's are missing there."""
        if i in self.groups:
            self._ok(i)[ranks, slots] = False

    def computed(self, i: int, scheduled) -> None:
        """A forward of group i writes these slots, through the draft too (its mirror)."""
        if i in self.groups:
            ok = self._ok(i)
            for s in scheduled:
                ok[s.placement.ranks, s.placement.slots] = True


def fill_batches(reqs: list[Request], ok: np.ndarray, n: int, chunk: int = FILL_CHUNK
                 ) -> tuple[list[ForwardBatch], list[tuple[np.ndarray, np.ndarray]], list[Request]]:
    """The draft-only prefill forwards that recompute the draft's missing rows of `reqs` (each from its first
    missing position to its last stored one: a row's keys see every earlier row), one chunk of each request per
    forward; the (ranks, slots) they write; and the requests left for another round, whose missing rows another
    request here writes (a prefix they share: computed once, then matched)."""
    parts: list[list[SeqInput]] = []
    written, later = [], []
    claimed = np.zeros_like(ok)
    for req in reqs:
        ranks, slots = path_layout(req.kv)
        missing = np.flatnonzero(~ok[ranks, slots])
        if not len(missing):
            continue
        first = int(missing[0])
        if claimed[ranks[first:], slots[first:]].any():
            later.append(req)
            continue
        claimed[ranks[first:], slots[first:]] = True
        known = req.known_array()
        written.append((ranks[first:], slots[first:]))
        for c, a in enumerate(range(first, len(ranks), chunk)):
            b = min(len(ranks), a + chunk)
            runs = tuple(_runs(slots[:a][ranks[:a] == r]) for r in range(n))
            held = set(np.unique(ranks[:b]).tolist())
            seq = SeqInput(np.asarray(known[a:b], dtype=np.int64), a, ranks[a:b], slots[a:b], runs, None,
                           spread=len(held) > 1)
            if c == len(parts):
                parts.append([])
            parts[c].append(seq)
    batches = [ForwardBatch(tuple(p), "pass-kv" if any(s.spread for s in p) else "local", "prefill")
               for p in parts]
    return batches, written, later


def _runs(slots: np.ndarray) -> np.ndarray:
    """Slots (in path order) → [R, 2] runs [first, end) of consecutive slots."""
    slots = np.asarray(slots, dtype=np.int64)
    if not len(slots):
        return np.zeros((0, 2), dtype=np.int64)
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(slots)]))
    return np.stack((slots[starts], slots[ends - 1] + 1), axis=1).astype(np.int64)
