"""Local partial attention: `(out, lse)` of a query block against one key/value block (no communication).

Visibility follows the `cp_attention` contract: query i sees key j iff `q_seq[i] >= 0`,
`kv_seq[j] <= q_seq[i] < kv_seq_end[j]` and `kv_pos[j] <= q_pos[i]` (and, with a sliding `window`,
`q_pos[i] - kv_pos[j] < window`; with an attention `chunk` C, `q_pos[i] // C == kv_pos[j] // C`). `kv_seq_end`
defaults to `kv_seq + 1`
("same sequence id"); with prefix-tree segments numbered in DFS preorder a key carries its segment's interval
[number, end of its subtree) and a query its own leaf segment's number, so a shared prefix is visible to every
branch below it. Negative key ids are padding and match nothing. A *plan* (`build_items`) turns the metadata into
a short list of kernel calls — fully visible blocks, top-left causal squares, and small masked tiles only where
positions are irregular or along a window's trailing edge — so no dense mask over a long sequence is ever built
and invisible blocks (incl. keys that fell out of every query's window) are skipped. Items and their execution live
in `items.py`, the per-item kernels in `kernels.py` (re-exported here); whole-step backends in `backends.py`.

A chunk is a label, not a mask: `chunk_labels` folds each token's chunk index into its sequence label (and each key's
interval), so tokens of different chunks never match and every planner, route and in-kernel backend below applies
the chunk rule without knowing it — segments break at chunk boundaries, keys of other chunks are never visited.
"""
from __future__ import annotations

import numpy as np
import torch

from cpinfer.attention.items import (CAUSAL, FULL, MASK, AttentionBackend, AttnItem,  # noqa: F401 (re-exported)
                                     mark_first, new_accumulator, run_items)
from cpinfer.attention.kernels import (cpu_flash_backend, kernel_by_name, register_backend,  # noqa: F401
                                       sdpa_math_backend)

_TILE_Q, _TILE_K = 64, 256  # tile sizes for irregular metadata
MIN_STAIR = 16  # for per-item kernels (cpu-flash): shorter causal runs are cheaper as one masked tile


# ---------------------------------------------------------------- planning (metadata only, numpy)

def seq_end_or_default(kv_seq: np.ndarray, kv_seq_end) -> np.ndarray:
    """kv_seq_end as int64 (default kv_seq + 1); padding keys (kv_seq < 0) get an empty interval."""
    if kv_seq_end is None:
        return kv_seq + 1
    end = np.asarray(_np(kv_seq_end), dtype=np.int64)
    if end.shape != kv_seq.shape:
        raise ValueError(f"kv_seq_end has shape {end.shape} but kv_seq has {kv_seq.shape}; they must match")
    return np.where(kv_seq < 0, kv_seq + 1, end)


def visible(q_seq, q_pos, kv_seq, kv_pos, kv_seq_end, window: int | None = None,
            chunk: int | None = None) -> np.ndarray:
    """Dense visibility [Lq, Lkv] bool of the rule (small blocks and tests only); padding keys match nothing."""
    qs, qp, ks = q_seq[:, None], q_pos[:, None], kv_seq[None, :]
    vis = (qs >= 0) & (ks >= 0) & (ks <= qs) & (qs < kv_seq_end[None, :]) & (kv_pos[None, :] <= qp)
    if chunk is not None:
        vis &= qp // chunk == kv_pos[None, :] // chunk
    return vis if window is None else vis & (qp - kv_pos[None, :] < window)


def chunk_labels(q_meta, kv_meta, chunk: int | None):
    """Fold the chunk rule into the labels: (q_seq, q_pos) and (kv_seq, kv_pos, kv_seq_end) int64 arrays per rank →
    the same with labels chunk' * S + seq and intervals [chunk' * S + kv_seq, chunk' * S + kv_seq_end), chunk' the
    rank of pos // chunk among the chunks present and S above every label and interval end. A query's label then
    lies in a key's interval iff it did before and both are in one chunk. Padding (negative labels) stays as it is.
    Labels stay below (#chunks present) x S (int32 kernels). chunk None: the metadata unchanged."""
    if chunk is None:
        return q_meta, kv_meta
    real = [p[s >= 0] // chunk for s, p in q_meta] + [p[s >= 0] // chunk for s, p, _ in kv_meta]
    present = np.unique(np.concatenate(real)) if real else np.zeros(0, np.int64)
    tops = [s[s >= 0] + 1 for s, _ in q_meta] + [e[s >= 0] for s, _, e in kv_meta]
    span = int(max((int(t.max()) for t in tops if len(t)), default=1))

    def base(seq, pos):  # chunk' * S for real entries, 0 for padding
        return np.where(seq >= 0, np.searchsorted(present, pos // chunk) * span, 0)

    q_out = [(s + base(s, p), p) for s, p in q_meta]
    kv_out = [(s + base(s, p), p, e + base(s, p)) for s, p, e in kv_meta]
    return q_out, kv_out


def _segments(pos: np.ndarray, *labels: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of constant labels (first label non-negative) with strictly increasing positions."""
    n = len(pos)
    if n == 0:
        return []
    change = pos[1:] <= pos[:-1]
    for lab in labels:
        change = change | (lab[1:] != lab[:-1])
    brk = np.nonzero(change)[0] + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [n]))
    return [(int(a), int(b)) for a, b in zip(starts, ends) if labels[0][a] >= 0]


def _pair_items(qpos: np.ndarray, kpos: np.ndarray, q0: int, k0: int, min_stair: int = MIN_STAIR) -> list[AttnItem]:
    """Items for one query segment against one key segment it can see (both sorted by position).

    Row r sees keys [0, c[r]) with c nondecreasing. Walking down the rows: keys every remaining row sees become
    one FULL block; a run of rows whose extra keys grow by one per row is a top-left CAUSAL square; anything
    irregular becomes a small MASK tile of at most _TILE_Q rows.
    """
    n, kn = len(qpos), len(kpos)
    c = np.searchsorted(kpos, qpos, side="right")
    r = int(np.searchsorted(c, 0, side="right"))  # rows before r see nothing
    done = 0  # keys [0, done) already given to every row from r on
    items = []
    while r < n:
        b = int(c[r])
        if b == kn:  # every row from r on sees every key
            items.append(AttnItem(q0 + r, q0 + n, k0 + done, k0 + kn, FULL))
            break
        r_same = int(np.searchsorted(c, b, side="right"))  # rows [r, r_same) see exactly keys [0, b)
        if r_same - r > 1:  # no stair starts here: keys [done, b) are visible to every row from r on
            items.append(AttnItem(q0 + r, q0 + n, k0 + done, k0 + b, FULL))
            done, r = b, r_same
            continue
        if b - 1 > done:
            items.append(AttnItem(q0 + r, q0 + n, k0 + done, k0 + b - 1, FULL))
            done = b - 1
        d = c[r:] - done  # ≥ 1: row r sees exactly one key past `done`
        stair = d == np.arange(1, len(d) + 1)
        rs = len(d) if stair.all() else int(np.argmin(stair))
        if rs >= min_stair or rs == len(d):
            items.append(AttnItem(q0 + r, q0 + r + rs, k0 + done, k0 + done + rs, CAUSAL))
            r += rs
        else:
            r2 = min(n, r + _TILE_Q)
            width = int(c[r2 - 1]) - done
            mask = torch.from_numpy(np.arange(width)[None, :] < d[:r2 - r, None])
            items.append(AttnItem(q0 + r, q0 + r2, k0 + done, k0 + done + width, MASK, mask))
            r = r2
    return items


def _band_rows(window: int) -> int:
    """Query rows per block of a windowed band: the trailing edge's masked tile costs rows^2 / 2 of wasted work
    against rows x window of useful work, so blocks of window / 8 rows (64 .. 512)."""
    return int(min(max(_TILE_Q, window // 8), 512))


def _band_items(qpos: np.ndarray, kpos: np.ndarray, q0: int, k0: int, window: int,
                min_stair: int = MIN_STAIR) -> list[AttnItem]:
    """Items for one query segment against one key segment under a sliding window (both sorted by position).

    Row r sees keys [lo[r], c[r]) with lo and c nondecreasing. Per block of rows: keys [lo[first], lo[last]) are
    the window's trailing edge (a MASK tile), keys [lo[last], c[first]) every row sees (FULL), and keys from
    max(lo[last], c[first]) on are inside every row's window, so the causal rule alone decides (`_pair_items`).
    Keys before lo[first] — out of every row's window — are never visited.
    """
    c = np.searchsorted(kpos, qpos, side="right")
    lo = np.searchsorted(kpos, qpos - window, side="right")
    items: list[AttnItem] = []
    m = _band_rows(window)
    for a in range(0, len(qpos), m):
        b = min(len(qpos), a + m)
        first_lo, last_lo, first_c, last_c = int(lo[a]), int(lo[b - 1]), int(c[a]), int(c[b - 1])
        edge_hi = min(last_lo, last_c)
        if edge_hi > first_lo:
            keys = np.arange(first_lo, edge_hi)
            mask = (keys[None, :] >= lo[a:b, None]) & (keys[None, :] < c[a:b, None])  # [b-a, edge_hi-first_lo]
            if mask.any():
                items.append(AttnItem(q0 + a, q0 + b, k0 + first_lo, k0 + edge_hi, MASK, torch.from_numpy(mask)))
        if first_c > last_lo:
            items.append(AttnItem(q0 + a, q0 + b, k0 + last_lo, k0 + first_c, FULL))
        start = max(last_lo, first_c)
        if last_c > start:
            items.extend(_pair_items(qpos[a:b], kpos[start:], q0 + a, k0 + start, min_stair))
    return items


def _intervals(kv_seq, kv_end, kv_segs):
    """Distinct key intervals: (lo [U], hi [U]) and, per interval, its key segments in order."""
    by_iv: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b in kv_segs:
        by_iv.setdefault((int(kv_seq[a]), int(kv_end[a])), []).append((a, b))
    lo = np.fromiter((iv[0] for iv in by_iv), dtype=np.int64, count=len(by_iv))
    hi = np.fromiter((iv[1] for iv in by_iv), dtype=np.int64, count=len(by_iv))
    return lo, hi, list(by_iv.values())


def _segment_items(q_seq, q_pos, kv_pos, q_segs, intervals, window=None, min_stair=MIN_STAIR) -> list[AttnItem]:
    """Each query segment against every key segment whose interval holds the query's label."""
    lo, hi, segs = intervals
    items = []
    for qa, qb in q_segs:
        s = q_seq[qa]
        for u in np.nonzero((lo <= s) & (s < hi))[0]:
            for ka, kb in segs[u]:
                if kv_pos[ka] > q_pos[qb - 1]:
                    continue  # every key is in the future of every query
                if window is None:
                    items.extend(_pair_items(q_pos[qa:qb], kv_pos[ka:kb], qa, ka, min_stair))
                elif q_pos[qa] - kv_pos[kb - 1] < window:  # else every key left every query's window
                    items.extend(_band_items(q_pos[qa:qb], kv_pos[ka:kb], qa, ka, window, min_stair))
    return items


def _tile_items(q_seq, q_pos, kv_seq, kv_pos, kv_end, window=None) -> list[AttnItem]:
    """Fragmented metadata (e.g. random placement): fixed tiles, classified; masks exist only per tile."""
    items = []
    for qa in range(0, len(q_seq), _TILE_Q):
        qs, qp = q_seq[qa:qa + _TILE_Q], q_pos[qa:qa + _TILE_Q]
        for ka in range(0, len(kv_seq), _TILE_K):
            sl = slice(ka, ka + _TILE_K)
            vis = visible(qs, qp, kv_seq[sl], kv_pos[sl], kv_end[sl], window)
            if not vis.any():
                continue
            qb, kb = qa + len(qs), ka + vis.shape[1]
            if vis.all():
                items.append(AttnItem(qa, qb, ka, kb, FULL))
            else:
                items.append(AttnItem(qa, qb, ka, kb, MASK, torch.from_numpy(vis)))
    return items


def build_items(q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=None, window: int | None = None,
                min_stair: int = MIN_STAIR, chunk: int | None = None) -> list[AttnItem]:
    """Plan the kernel calls for queries against keys (metadata as int64 numpy arrays or CPU tensors).

    A query segment may pair with several key segments: every one whose [kv_seq, kv_seq_end) holds its label.
    window: a sliding window (keys with q_pos - kv_pos >= window are invisible), or None.
    min_stair: causal runs shorter than this become MASK tiles (cheaper for a per-item kernel such as cpu-flash);
    backends that take CAUSAL squares into a table (triton, flash-attn) plan with 1.
    chunk: an attention chunk (keys of another chunk of `chunk` positions are invisible), or None; in-kernel
    backends must then read the vectors of `chunk_labels`, not the raw labels.
    """
    q_seq, q_pos, kv_seq, kv_pos = (_np(x) for x in (q_seq, q_pos, kv_seq, kv_pos))
    kv_end = seq_end_or_default(kv_seq, kv_seq_end)
    [(q_seq, q_pos)], [(kv_seq, kv_pos, kv_end)] = chunk_labels([(q_seq, q_pos)], [(kv_seq, kv_pos, kv_end)], chunk)
    q_segs, kv_segs = _segments(q_pos, q_seq), _segments(kv_pos, kv_seq, kv_end)
    intervals = _intervals(kv_seq, kv_end, kv_segs)
    lo, hi, segs = intervals
    labels = np.fromiter((q_seq[a] for a, _ in q_segs), dtype=np.int64, count=len(q_segs))
    per_iv = np.fromiter((len(x) for x in segs), dtype=np.int64, count=len(segs))
    pairs = int((((lo[None, :] <= labels[:, None]) & (labels[:, None] < hi[None, :])) * per_iv).sum())
    tiles = -(-len(q_seq) // _TILE_Q) * -(-len(kv_seq) // _TILE_K)
    if pairs > tiles + 64:  # fragmented metadata (e.g. random placement): fixed tiles are cheaper
        items = _tile_items(q_seq, q_pos, kv_seq, kv_pos, kv_end, window)
    else:
        items = _segment_items(q_seq, q_pos, kv_pos, q_segs, intervals, window, min_stair)
    return mark_first(items, len(q_seq))


def local_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, scale=None, backend=None, kv_seq_end=None, window=None,
                    chunk=None):
    """(out [Lq, H, D] fp32, lse [Lq, H] fp32) of q against k/v under the visibility rule; empty rows → 0, -inf.
    backend: a per-item kernel (None, "cpu-flash", "math"); `backends.attend_local` takes every backend name."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    items = build_items(q_seq, q_pos, kv_seq, kv_pos, kv_seq_end, window, chunk=chunk)
    acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)
    run_items(items, q, k, v, acc_out, acc_lse, scale, kernel_by_name(backend, q.device))
    return acc_out, acc_lse


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy().astype(np.int64) if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.int64)


def reference_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, scale=None, kv_seq_end=None, window=None,
                        chunk=None, sinks=None):
    """Dense float64 reference for tests (small inputs only): (out [Lq, H, D] f64, lse [Lq, H] f64).
    sinks [H]: one more logit per head in every row's softmax, with no value (a row without keys gets zeros)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    kv_seq_np = _np(kv_seq)
    vis = torch.from_numpy(visible(_np(q_seq), _np(q_pos), kv_seq_np, _np(kv_pos),
                                   seq_end_or_default(kv_seq_np, kv_seq_end), window, chunk)).to(q.device)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    s = s.masked_fill(~vis[None], -torch.inf)
    if sinks is not None:  # the sink's column: its logit in the denominator, zero value
        col = sinks.double().reshape(-1, 1, 1).expand(-1, s.shape[1], 1)
        s = torch.cat((s, col), dim=-1)
        vv = torch.cat((vv, vv.new_zeros(1, vv.shape[1], vv.shape[2])))
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, lse.transpose(0, 1)
