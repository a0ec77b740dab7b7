"""The once-per-forward plan of `cp_attention`: validated metadata of every rank and the kernel calls per ring step.

Without a window the steps go around the ring (paper Alg. 2-4). With a sliding window a plan routes each step
directly from rank r - j to rank r (`Routes`): only rows some query can see travel, pairs with nothing to move
post no message, and a step that is empty for every rank is skipped by all of them.

Building a plan costs one small exchange of shapes and metadata (or none, when the caller already knows every
rank's metadata, as the engine does); running it per layer only moves and multiplies tensors. Bad input is
detected on the rank that has it and reported as the same `ValueError` on every rank before any tensor moves.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.backends import resolve_name
from cpinfer.attention.local import AttnItem, build_items, mark_first, seq_end_or_default
from cpinfer.cp.ring import group_rank_and_size

STRATEGIES = ("pass-kv", "pass-q", "all-gather")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@dataclasses.dataclass(frozen=True)
class RankMeta:
    """One rank's metadata. q_*: its queries; kv_*: its whole local K/V; send: rows of K/V that travel."""

    q_seq: np.ndarray
    q_pos: np.ndarray
    kv_seq: np.ndarray
    kv_pos: np.ndarray
    send: np.ndarray  # indices into the local K/V of rows that can matter to some query (packed for sending)
    kv_end: np.ndarray | None = None  # end of each key's interval [kv_seq, kv_end); None → kv_seq + 1

    def __post_init__(self):
        if self.kv_end is None:
            object.__setattr__(self, "kv_end", self.kv_seq + 1)


@dataclasses.dataclass
class CPAttentionPlan:
    """Everything a rank needs to run one strategy; built once, reused by every layer of a forward."""

    group: object
    rank: int
    world: int
    strategy: str
    scale: float | None
    metas: list[RankMeta]
    steps: list[list[AttnItem]]  # per ring step j (source (rank - j) mod N for pass-KV, (rank - j) for pass-Q)
    max_q: int  # longest query block over ranks (pass-Q message rows)
    max_send: int  # longest packed K/V over ranks (pass-KV / all-gather message rows)
    backend: str = "auto"  # attention backend name (cpinfer.attention.backends), resolved on the tensors' device
    window: int | None = None  # sliding window: keys with q_pos - kv_pos >= window are invisible
    routes: Routes | None = None  # direct schedule (with a window): per pair of ranks the rows that travel

    @property
    def me(self) -> RankMeta:
        return self.metas[self.rank]

    @property
    def direct(self) -> bool:
        """Step j goes straight from rank (r - j) to rank r, skipping empty pairs, instead of around the ring."""
        return self.routes is not None

    def source(self, step: int) -> int:
        return (self.rank - step) % self.world

    def step_vectors(self, j: int) -> tuple[np.ndarray, ...]:
        """Metadata of ring step j as int64 arrays (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos), in the row order of
        the step's `AttnItem`s: pass-KV / all-gather — my queries against my own K/V (j = 0) or source j's packed
        K/V; pass-Q — source j's queries (those that travel) against my K/V. In-kernel backends read these."""
        src, me = self.metas[self.source(j)], self.me
        if self.strategy == "pass-q":
            qs = slice(None) if j == 0 or not self.direct else self.routes.rows[self.source(j)][self.rank]
            return src.q_seq[qs], src.q_pos[qs], me.kv_seq, me.kv_end, me.kv_pos
        if j == 0:
            return me.q_seq, me.q_pos, me.kv_seq, me.kv_end, me.kv_pos
        sl = self.routes.rows[self.source(j)][self.rank] if self.direct else src.send
        return me.q_seq, me.q_pos, src.kv_seq[sl], src.kv_end[sl], src.kv_pos[sl]

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timings: list | None = None,
            scale: float | None = None) -> torch.Tensor:
        """q [Lq, H, D], k/v [Lkv, Hkv, D] (this rank's) → out [Lq, H, D] in q's dtype; `scale` overrides."""
        from cpinfer.cp import pass_kv, pass_q  # late import: the strategies import this module

        scale = scale if scale is not None else q.shape[-1] ** -0.5 if self.scale is None else self.scale
        if self.strategy == "pass-q":
            return (pass_q.run_direct if self.direct else pass_q.run)(self, q, k, v, scale, timings)
        if self.strategy == "all-gather":
            return pass_kv.run_all_gather(self, q, k, v, scale, timings)
        return (pass_kv.run_direct if self.direct else pass_kv.run)(self, q, k, v, scale, timings)


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


def _relevant_rows(q_labels: np.ndarray, kv_seq: np.ndarray, kv_end: np.ndarray) -> np.ndarray:
    """Rows of K/V whose interval [kv_seq, kv_end) holds some query's label (q_labels sorted, unique, >= 0)."""
    at = np.searchsorted(q_labels, kv_seq, side="left")  # first label >= kv_seq
    hit = at < len(q_labels)
    hit[hit] = q_labels[at[hit]] < kv_end[hit]
    return np.nonzero(hit & (kv_seq >= 0))[0].astype(np.int64)


def plan_from_metadata(q_meta, kv_meta, *, group, rank: int, world: int, strategy: str,
                       scale: float | None = None, backend: str = "auto", window: int | None = None) -> CPAttentionPlan:
    """Build a plan from every rank's metadata, known on all ranks: no communication.

    q_meta[r] = (q_seq, q_pos) and kv_meta[r] = (kv_seq, kv_pos) or (kv_seq, kv_pos, kv_seq_end) as int64 arrays,
    for r in range(world); a missing kv_seq_end means kv_seq + 1 (same sequence id). With a sliding `window`
    pass-KV and pass-Q use the direct schedule (`Routes`): only rows some query can see travel, and a step
    with nothing to move for any rank sends no message.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    problem = window_problem(window)
    if problem:
        raise ValueError(problem)
    q_meta = [(np.asarray(s, dtype=np.int64), np.asarray(p, dtype=np.int64)) for s, p in q_meta]
    kv_meta = [_kv_triple(m) for m in kv_meta]
    labels = np.unique(np.concatenate([s for s, _ in q_meta])) if q_meta else np.zeros(0, np.int64)
    labels = labels[labels >= 0]
    metas = [RankMeta(qs, qp, ks, kp, _relevant_rows(labels, ks, ke), ke)
             for (qs, qp), (ks, kp, ke) in zip(q_meta, kv_meta)]
    routes = None
    if window is not None and strategy != "all-gather":
        routes = pair_routes(metas, "q" if strategy == "pass-q" else "kv", window)
    plan = CPAttentionPlan(group, rank, world, strategy, scale, metas, [], max(len(m.q_seq) for m in metas),
                           max(len(m.send) for m in metas), backend, window, routes)
    covered = np.zeros(len(plan.me.q_seq), dtype=bool)
    for j in range(world):
        q_seq, q_pos, kv_seq, kv_end, kv_pos = plan.step_vectors(j)
        items = build_items(q_seq, q_pos, kv_seq, kv_pos, kv_end, window)
        if strategy == "pass-q":  # source's queries against my stationary K/V; one accumulator per source
            plan.steps.append(mark_first(items, len(q_seq)))
        else:  # my queries against my own K/V (read in place) or the source's packed K/V
            plan.steps.append(mark_first(items, len(covered), covered))
    return plan


def window_problem(window) -> str:
    """What is wrong with a `window` argument, or '' (None or a positive int is fine)."""
    if window is None:
        return ""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window <= 0:
        return f"window must be a positive integer (keys with q_pos - kv_pos >= window are invisible) or None, " \
               f"got {window!r}"
    return ""


def pair_routes(metas: list[RankMeta], kind: str, window: int) -> Routes:
    """For every ordered pair (s, r): K/V rows of s some query of r sees (kind "kv"), or query rows of s that see
    some key of r (kind "q"). The pair (r, r) is unused (local rows are read in place)."""
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


def _kv_triple(m) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(m) not in (2, 3):
        raise ValueError(f"kv_meta entries must be (kv_seq, kv_pos) or (kv_seq, kv_pos, kv_seq_end), got {len(m)}")
    ks, kp = np.asarray(m[0], dtype=np.int64), np.asarray(m[1], dtype=np.int64)
    return ks, kp, seq_end_or_default(ks, m[2] if len(m) == 3 else None)


# ---------------------------------------------------------------- validation and metadata exchange

def _local_problem(q, k, v, q_seq, q_pos, kv_seq, kv_pos, strategy, scale, kv_seq_end=None,
                   backend="auto", window=None) -> str:
    """A description of what is wrong with this rank's inputs, or '' if nothing is."""
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}"
    if window_problem(window):
        return window_problem(window)
    if isinstance(q, torch.Tensor):
        try:
            resolve_name(backend, q.device)
        except ValueError as exc:
            return str(exc)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            return f"{name} must be a 3-D tensor [tokens, heads, head_dim], got {getattr(t, 'shape', type(t))}"
        if t.dtype not in _DTYPES:
            return f"{name} must be a floating tensor ({', '.join(map(str, _DTYPES))}), got {t.dtype}"
    if k.shape != v.shape:
        return f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[2] != k.shape[2]:
        return f"q and k head_dim differ: {q.shape[2]} vs {k.shape[2]}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
    metadata = [("q_seq", q_seq, q.shape[0]), ("q_pos", q_pos, q.shape[0]),
                ("kv_seq", kv_seq, k.shape[0]), ("kv_pos", kv_pos, k.shape[0])]
    if kv_seq_end is not None:
        metadata.append(("kv_seq_end", kv_seq_end, k.shape[0]))
    for name, t, n in metadata:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
            return f"{name} must be a 1-D int64 tensor, got {getattr(t, 'dtype', type(t))} {getattr(t, 'shape', '')}"
        if t.shape[0] != n:
            return f"{name} has {t.shape[0]} entries but the matching tensor has {n} tokens"
    for name, pos, seq in (("q_pos", q_pos, q_seq), ("kv_pos", kv_pos, kv_seq)):
        if bool(((pos < 0) & (seq >= 0)).any()):
            return f"{name} has negative positions; positions must be >= 0"
    if kv_seq_end is not None and bool(((kv_seq_end <= kv_seq) & (kv_seq >= 0)).any()):
        return "kv_seq_end must be > kv_seq for every key with kv_seq >= 0 (an interval [kv_seq, kv_seq_end))"
    if scale is not None and not scale > 0:
        return f"scale must be positive, got {scale}"
    return ""


def _all_gather_ints(values: torch.Tensor, group) -> list[torch.Tensor]:
    """All-gather a small CPU int tensor; over an NCCL group it travels through this rank's CUDA device."""
    if dist.get_backend(group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
        out = [torch.empty_like(values, device=dev) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, values.to(dev), group=group)
        return [x.cpu() for x in out]
    out = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, values, group=group)
    return out


def exchange_and_plan(q, k, v, q_seq, q_pos, kv_seq, kv_pos, *, group, strategy, scale=None,
                      kv_seq_end=None, backend="auto", control_group=None, window=None) -> CPAttentionPlan:
    """Validate on every rank, agree on errors, all-gather metadata, then build the plan.

    control_group: a gloo group over the same ranks for the metadata (default: `group` itself)."""
    tensors_group, group = group, control_group if control_group is not None else group
    rank, world = group_rank_and_size(tensors_group)
    if group_rank_and_size(group) != (rank, world):
        raise ValueError(f"control_group must hold the same ranks in the same order as group: this rank is "
                         f"{group_rank_and_size(group)} there and {(rank, world)} in group")
    problem = _local_problem(q, k, v, q_seq, q_pos, kv_seq, kv_pos, strategy, scale, kv_seq_end, backend, window)
    ok = not problem
    header = torch.tensor([0 if ok else 1,
                           q.shape[0] if ok else 0, k.shape[0] if ok else 0,
                           q.shape[1] if ok else 0, k.shape[1] if ok else 0, q.shape[2] if ok else 0,
                           _DTYPES.index(q.dtype) if ok else -1, STRATEGIES.index(strategy) if ok else -1,
                           (window or 0) if ok else -1], dtype=torch.int64)
    headers = torch.stack(_all_gather_ints(header, group))  # [world, 9]
    if headers[:, 0].any():
        problems = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        bad = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        raise ValueError(f"cp_attention: bad input on {bad}")
    for col, what in ((3, "query heads"), (4, "key/value heads"), (5, "head_dim"), (6, "dtype"), (7, "strategy"),
                      (8, "window")):
        if (headers[:, col] != headers[0, col]).any():
            raise ValueError(f"cp_attention: ranks disagree on {what}: {headers[:, col].tolist()}")
    max_q, max_kv = int(headers[:, 1].max()), int(headers[:, 2].max())
    mine = torch.full((5, max(max_q, max_kv)), -1, dtype=torch.int64)
    mine[0, :q.shape[0]], mine[1, :q.shape[0]] = q_seq.cpu(), q_pos.cpu()
    mine[2, :k.shape[0]], mine[3, :k.shape[0]] = kv_seq.cpu(), kv_pos.cpu()
    mine[4, :k.shape[0]] = kv_seq.cpu() + 1 if kv_seq_end is None else kv_seq_end.cpu()
    gathered = _all_gather_ints(mine, group)
    q_meta = [(g[0, :h[1]].numpy(), g[1, :h[1]].numpy()) for g, h in zip(gathered, headers)]
    kv_meta = [(g[2, :h[2]].numpy(), g[3, :h[2]].numpy(), g[4, :h[2]].numpy()) for g, h in zip(gathered, headers)]
    return plan_from_metadata(q_meta, kv_meta, group=tensors_group, rank=rank, world=world, strategy=strategy,
                              scale=scale, backend=backend, window=window)
