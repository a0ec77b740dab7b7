"""The direct schedule of a windowed or chunked `cp_attention` plan: for every ordered pair of ranks, the rows one
must send the other — K/V rows some query of the receiver sees (pass-KV), or queries that see some key of the
receiver (pass-Q) — under the sliding-window rule (chunks are already folded into the labels: `chunk_labels`).
Every rank derives the same routes from the same metadata, so a pair with nothing to move posts no message and a
step that is empty for every rank is skipped by all of them.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cpinfer.cp.rank_meta import RankMeta

_NO_WINDOW = 2 ** 62  # above any position difference


@dataclasses.dataclass(frozen=True)
class Routes:
    """The direct schedule of a windowed plan: rows[s][r] are the rows rank s sends rank r — K/V rows (pass-KV)
    or query rows (pass-Q) of rank s that matter to rank r — as int64 indices; an empty array means no message.
    Every rank computes the same routes from the same metadata, so senders and receivers agree."""

    kind: str  # "kv" | "q"
    rows: list[list[np.ndarray]]

    def count(self, src: int, dst: int) -> int:
        return len(self.rows[src][dst])

    def empty_steps(self) -> list[int]:
        """Steps j >= 1 in which no rank sends anything (skipped by every rank)."""
        n = len(self.rows)
        return [j for j in range(1, n) if not any(self.count(s, (s + j) % n) for s in range(n))]


def pair_routes(metas: list[RankMeta], kind: str, window: int | None) -> Routes:
    """For every ordered pair (s, r): K/V rows of s some query of r sees (kind "kv"), or query rows of s that see
    some key of r (kind "q"). The pair (r, r) is unused (local rows are read in place). window None: no window."""
    window = _NO_WINDOW if window is None else window
    n = len(metas)
    rows: list[list[np.ndarray]] = [[np.zeros(0, np.int64)] * n for _ in range(n)]
    for s in range(n):
        for r in range(n):
            if s == r:
                continue
            if kind == "kv":
                src, dst = metas[s], metas[r]
                hit = _keys_seen(dst.q_seq, dst.q_pos, src.kv_seq, src.kv_end, src.kv_pos, window)
            else:
                src, dst = metas[s], metas[r]
                hit = _queries_seeing(src.q_seq, src.q_pos, dst.kv_seq, dst.kv_end, dst.kv_pos, window)
            rows[s][r] = np.nonzero(hit)[0].astype(np.int64)
    return Routes(kind, rows)


def _key_groups(kv_seq: np.ndarray, kv_end: np.ndarray):
    """(interval lo, interval hi, key indices) per distinct key interval [kv_seq, kv_end) (padding left out)."""
    valid = np.nonzero(kv_seq >= 0)[0]
    if len(valid) == 0:
        return []
    pairs = np.stack((kv_seq[valid], kv_end[valid]), axis=1)
    uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    bounds = np.searchsorted(inv[order], np.arange(len(uniq) + 1))
    return [(int(lo), int(hi), valid[order[bounds[u]:bounds[u + 1]]]) for u, (lo, hi) in enumerate(uniq)]


def _same_sequence(kv_seq: np.ndarray, kv_end: np.ndarray) -> bool:
    """Every real key's interval is its own label (no prefix tree): (label, position) pairs can be sorted."""
    real = kv_seq >= 0
    return bool(np.array_equal(kv_end[real], kv_seq[real] + 1))


def _keyed(seq: np.ndarray, pos: np.ndarray, span: int) -> np.ndarray:
    """(label, position) as one sortable int64 (labels >= 0, positions in [0, span))."""
    return seq * span + pos


def _keys_seen(q_seq, q_pos, kv_seq, kv_end, kv_pos, window) -> np.ndarray:
    """[Lk] bool: key j is visible to some query (label in its interval, kv_pos <= q_pos < kv_pos + window)."""
    if _same_sequence(kv_seq, kv_end):  # one sort instead of a loop over intervals (the engine's case)
        span = int(max(q_pos.max(initial=0), kv_pos.max(initial=0))) + 1
        real_q = q_seq >= 0
        qk = np.sort(_keyed(q_seq[real_q], q_pos[real_q], span))
        kk = _keyed(np.maximum(kv_seq, 0), kv_pos, span)
        at = np.searchsorted(qk, kk, side="left")  # the first query of the key's label at or after it
        ok = (at < len(qk)) & (kv_seq >= 0)
        nxt = qk[np.minimum(at, len(qk) - 1)] if len(qk) else kk
        return ok & (nxt // span == kv_seq) & (nxt - kk < window)
    hit = np.zeros(len(kv_seq), dtype=bool)
    for lo, hi, keys in _key_groups(kv_seq, kv_end):
        p = np.sort(q_pos[(q_seq >= lo) & (q_seq < hi)])
        if len(p) == 0:
            continue
        kp = kv_pos[keys]
        at = np.searchsorted(p, kp, side="left")  # the first query at or after the key
        ok = at < len(p)
        ok[ok] = p[at[ok]] - kp[ok] < window
        hit[keys] = ok
    return hit


def _queries_seeing(q_seq, q_pos, kv_seq, kv_end, kv_pos, window) -> np.ndarray:
    """[Lq] bool: query i sees some key (its label in the key's interval, q_pos - window < kv_pos <= q_pos)."""
    if _same_sequence(kv_seq, kv_end):
        span = int(max(q_pos.max(initial=0), kv_pos.max(initial=0))) + 1
        real_k = kv_seq >= 0
        kk = np.sort(_keyed(kv_seq[real_k], kv_pos[real_k], span))
        qk = _keyed(np.maximum(q_seq, 0), q_pos, span)
        at = np.searchsorted(kk, qk, side="right") - 1  # the newest key of the query's label at or before it
        ok = (at >= 0) & (q_seq >= 0)
        prev = kk[np.maximum(at, 0)] if len(kk) else qk
        return ok & (prev // span == q_seq) & (qk - prev < window)
    hit = np.zeros(len(q_seq), dtype=bool)
    for lo, hi, keys in _key_groups(kv_seq, kv_end):
        qs = np.nonzero((q_seq >= lo) & (q_seq < hi))[0]
        if len(qs) == 0:
            continue
        k = np.sort(kv_pos[keys])
        at = np.searchsorted(k, q_pos[qs], side="right") - 1  # the newest key at or before the query
        ok = at >= 0
        ok[ok] = q_pos[qs[ok]] - k[at[ok]] < window
        hit[qs[ok]] = True
    return hit
