"""Exact top-k selection and attention over the selected keys (DeepSeek sparse attention), as pure functions.

The order of keys for a query row is total and the same everywhere: a higher indexer score first, equal scores by
the smaller position. So the global top-k of a row is the first k of the union of every rank's local top-k lists,
and it is fixed by its last member (the threshold): a key is selected iff it is visible and not after the threshold
in that order. Attention over the selected keys a rank owns gives a partial (out, lse) that merges exactly by LSE.
"""
from __future__ import annotations

import torch
from torch import Tensor

NO_POS = -1  # the position of an empty candidate (score -inf)
_GATHER_ELEMS = 1 << 22  # selected key elements gathered at once by `attend_selected`


def ordered_topk(scores: Tensor, pos: Tensor, k: int, static: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """scores [Q, K] fp32 (-inf: invisible), pos [K] (or [Q, K]: a key list per row) int64 in increasing order ->
    each row's first k keys in the order (score desc, position asc), as a set in position order, padded to k:
    (values [Q, k] fp32, positions [Q, k] int64 (NO_POS where empty), indices into the K keys [Q, k] int64 (0 where
    empty)). One top-k for the k-th value, then the ties at it taken by position: O(Q K), no sort of the K keys.
    `static`: no data-dependent shape (the static decode path: the chosen keys gathered by a second top-k instead of
    `nonzero`, which reads its count back to the host)."""
    q, n = scores.shape
    vals = torch.full((q, k), -torch.inf, dtype=torch.float32, device=scores.device)
    where = torch.full((q, k), NO_POS, dtype=torch.int64, device=scores.device)
    idx = torch.zeros((q, k), dtype=torch.int64, device=scores.device)
    m = min(k, n)
    if m and q:
        kth = torch.topk(scores, m, dim=1, sorted=False).values.amin(dim=1, keepdim=True)  # [Q, 1]
        above, tie = scores > kth, scores == kth
        need = m - above.sum(dim=1, keepdim=True)  # [Q, 1] keys still to take from the ties, earliest first
        chosen = above | (tie & (torch.cumsum(tie, dim=1) <= need))  # [Q, K], exactly m per row
        if static:
            later = torch.arange(n, 0, -1, device=scores.device, dtype=torch.float32)  # earlier keys rank higher
            i = torch.topk(torch.where(chosen, later, 0.0), m, dim=1).indices  # [Q, m] the chosen, in position order
        else:
            i = torch.nonzero(chosen)[:, 1].view(q, m)  # [Q, m] in position order
        v = scores.gather(1, i)
        vals[:, :m], idx[:, :m] = v, i
        where[:, :m] = torch.where(torch.isfinite(v), pos[i] if pos.dim() == 1 else pos.gather(1, i), NO_POS)
    return vals, where, idx


def threshold(vals: Tensor, pos: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Candidates of each row from every rank, vals / pos [Q, C] -> the k-th of their union in the order (score
    desc, position asc): (score [Q], position [Q]); (-inf, NO_POS) when a row has fewer than k finite candidates
    (then every visible key is selected)."""
    q = vals.shape[0]
    if vals.shape[1] == 0 or q == 0:
        return vals.new_full((q,), -torch.inf), pos.new_full((q,), NO_POS)
    by_pos = torch.argsort(torch.where(pos < 0, torch.iinfo(torch.int64).max, pos), dim=1, stable=True)
    v, p = vals.gather(1, by_pos), pos.gather(1, by_pos)
    s, order = torch.sort(v, dim=1, descending=True, stable=True)
    p = p.gather(1, order)
    if s.shape[1] < k:
        return vals.new_full((q,), -torch.inf), pos.new_full((q,), NO_POS)
    ts, tp = s[:, k - 1], p[:, k - 1]
    short = ~torch.isfinite(ts)  # fewer than k visible keys: all of them (no data-dependent shape: CUDA graphs)
    return torch.where(short, -torch.inf, ts), torch.where(short, NO_POS, tp)


def selected(vals: Tensor, pos: Tensor, ts: Tensor, tp: Tensor) -> Tensor:
    """Candidates vals / pos [Q, k] of one rank, the rows' thresholds ts / tp [Q] -> [Q, k] bool: in the top-k."""
    ts, tp = ts[:, None], tp[:, None]
    keep = (vals > ts) | ((vals == ts) & (pos <= tp))
    return keep & torch.isfinite(vals)


def attend_selected(q: Tensor, keys: Tensor, slots: Tensor, keep: Tensor, dv: int,
                    scale: float, decode=None) -> tuple[Tensor, Tensor]:
    """Absorbed-MLA attention of each row over its selected keys: q [Q, H, D], keys [N, D] (latent rows, e.g. the
    store; values = their first dv channels), slots / keep [Q, k] (rows of `keys`, whether selected) -> (out
    [Q, H, dv] fp32, lse [Q, H] fp32; zeros / -inf for a row with no selected key). Reads Q x k rows, in chunks of
    rows (memory O(chunk x k x D)). `decode`: stored rows [N, D] (e.g. FP8 bytes) -> their values, applied to the
    rows read."""
    nq, h = q.shape[0], q.shape[1]
    out = torch.zeros((nq, h, dv), dtype=torch.float32, device=q.device)
    lse = torch.full((nq, h), -torch.inf, dtype=torch.float32, device=q.device)
    k = slots.shape[1]
    if not k or not nq:
        return out, lse
    step = max(1, _GATHER_ELEMS // (k * keys.shape[1]))
    for a in range(0, nq, step):
        e = min(nq, a + step)
        kk = keys.index_select(0, slots[a:e].reshape(-1))  # [c * k, D]
        kk = (kk if decode is None else decode(kk)).view(e - a, k, -1).float()  # [c, k, D]
        s = torch.matmul(q[a:e].float(), kk.transpose(1, 2)) * scale  # [c, H, k]
        s = s.masked_fill(~keep[a:e, None, :], -torch.inf)
        m = torch.logsumexp(s, dim=-1)  # [c, H]
        p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)[..., None])  # [c, H, k] (0 where masked)
        out[a:e] = torch.matmul(p, kk[..., :dv])
        lse[a:e] = m
    return out, lse


__all__ = ["NO_POS", "attend_selected", "ordered_topk", "selected", "threshold"]
