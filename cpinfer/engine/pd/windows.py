"""Sliding-window layers under P/D (paper §4.3): a handoff sends a windowed layer only the rows a decode still sees,
so each decode group keeps, per slot, whether its row is there for every layer (`WindowedRows`), and a prefix match
there never ends where a window needs a row that was not sent."""
from __future__ import annotations

import contextlib

import numpy as np

from cpinfer.cp.pd_plan import TransferPlan
from cpinfer.engine.pd.paths import nodes_layout, path_nodes


class WindowedRows:
    """Per decode group (index 1 + g), [decode CP, slots + 1] bool: the slot's row is there for every layer (False: a
    windowed layer's row was not sent). Empty for a model without windowed layers."""

    def __init__(self, windows, decode_groups: list, decode_cp: int):
        wins = [w for w in windows if w is not None]
        self.w_min, self.w_max = (min(wins), max(wins)) if wins else (None, None)
        self.complete: dict[int, np.ndarray] = {}
        self.match_from: int | None = None  # while a handoff attaches: the first position its decode needs
        if wins:
            for i, g in enumerate(decode_groups, start=1):
                self.complete[i] = np.ones((decode_cp, g.kv.capacity_per_rank + 1), dtype=bool)
                g.kv.match = self._windowed_match(i, g.kv, g.kv.match)

    def tracks(self, i: int) -> bool:
        return i in self.complete

    def computed(self, i: int, scheduled) -> None:
        """Rows a decode forward of group i computes are there for every layer."""
        for s in scheduled:
            self.complete[i][s.placement.ranks, s.placement.slots] = True

    def sent(self, i: int, plan: TransferPlan, stored: int) -> None:
        """A handoff of `stored` tokens to group i: windowed layers get the rows at positions >= stored - window."""
        self.complete[i][plan.dst_ranks, plan.dst_slots] = plan.positions >= stored - self.w_min

    def all_there(self, i: int, ranks: np.ndarray, slots: np.ndarray) -> bool:
        """Whether group i holds every layer's row of these slots (always, when it does not track them)."""
        return i not in self.complete or bool(self.complete[i][ranks, slots].all())

    @contextlib.contextmanager
    def attaching(self, stored: int):
        """While a handoff of `stored` tokens attaches on a decode group: its match needs the rows its decode sees."""
        self.match_from = None if self.w_max is None else stored - self.w_max
        try:
            yield
        finally:
            self.match_from = None

    def _windowed_match(self, i: int, kv, match):
        """Decode group i's prefix match, cut before a windowed layer's row that the request needs and that was not
        sent. A handoff of S tokens (`match_from` = S - window) needs the rows at positions >= S - window: the match
        ends at the first missing one there (the rest is sent, each row the window needs with it). Otherwise (a
        request recomputing after a preemption) the match ends at the longest m whose positions [m - window, m) all
        have every layer's row, as the recomputed queries from m on see them."""
        ok = self.complete[i]

        def windowed(tokens, limit, through_holes=False):
            node, inside, matched = match(tokens, limit, through_holes)
            if matched == 0 or ok.all():
                return node, inside, matched
            need = self.match_from
            nodes = path_nodes(node)
            ranks, slots = nodes_layout(nodes)
            bad = ~ok[ranks[:matched], slots[:matched]]  # [matched]: a windowed layer's row missing at that position
            if not bad[max(0, matched - self.w_max if need is None else need):].any():
                return node, inside, matched
            if need is not None:  # the first missing row the handoff needs
                best = max(0, need) + int(np.flatnonzero(bad[max(0, need):])[0])
            else:
                before = np.concatenate([[0], np.cumsum(bad)])  # missing rows before each position
                ends = np.arange(matched + 1)
                fine = before[ends] == before[np.maximum(0, ends - self.w_max)]
                best = int(np.flatnonzero(fine).max())
            if best == 0:
                return kv.root, 0, 0
            n = next(n for n in nodes if n.pos0 < best <= n.pos0 + len(n))
            return n, best - n.pos0, best

        return windowed
