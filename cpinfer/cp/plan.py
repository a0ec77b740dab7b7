"""The once-per-forward plan of `cp_attention`: validated metadata of every rank and the kernel calls per ring step.

Without a window or chunk the steps go around the ring (paper Alg. 2-4). With a sliding window or an attention
chunk a plan routes each step directly from rank r - j to rank r (`Routes`): only rows some query can see travel,
pairs with nothing to move post no message, and a step that is empty for every rank is skipped by all of them. A
chunk enters as labels (`chunk_labels`): tokens of different chunks never match, so tiles, rows and steps across a
chunk boundary are skipped like keys out of a window. Sinks are merged once, after every partial (`merge_sink`).

Building a plan costs one small exchange of shapes and metadata (or none, when the caller already knows every
rank's metadata, as the engine does); running it per layer only moves and multiplies tensors. Bad input is
detected on the rank that has it and reported as the same `ValueError` on every rank before any tensor moves.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.backends import backend_for, min_stair, resolve_name
from cpinfer.attention.kv_pack import values_in_keys
from cpinfer.attention.local import AttnItem, build_items, chunk_labels, mark_first, seq_end_or_default
from cpinfer.attention.step import HeadLayout, plan_tables
from cpinfer.attention.tables import ForwardTables
from cpinfer.cp import pass_kv, pass_q
from cpinfer.cp.rank_meta import RankMeta
from cpinfer.cp.ring import group_rank_and_size
from cpinfer.cp.routes import Routes, pair_routes

STRATEGIES = ("pass-kv", "pass-q", "all-gather")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


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
    routes: Routes | None = None  # direct schedule (window or chunk): per pair of ranks the rows that travel
    tables: ForwardTables | None = None  # device tables (None: the plan's own, made by `prepare`)
    table_prefix: tuple = ()  # this plan's keys in shared tables (the engine's forward holds several plans)
    chunk: int | None = None  # attention chunk (already folded into the metas' labels)
    values_in_keys: bool = False  # v is k[..., :Dv] (MLA's latent): K/V messages carry the keys alone (`kv_pack`)

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

    def key(self, *parts) -> tuple:
        return tuple(self.table_prefix) + parts

    def prepare(self, layout: HeadLayout, device, tables: ForwardTables | None = None) -> ForwardTables:
        """Put every device table a run reads — each step's kernel tables, the packed K/V rows, the direct
        schedule's indices — into `tables` (default: the plan's own), before the ring. The caller uploads them
        (the engine once per forward, with everything else); `run` uploads whatever is still pending."""
        if tables is not None:
            self.tables = tables
        tables = plan_tables(self, device)
        if self.key("ready") in tables.meta:
            return tables
        backend_for(self, device).prepare_plan(self, layout, tables)
        n, me = self.world, self.rank
        if self.direct:
            for j in range(1, n):
                sel = self.routes.rows[me][(me + j) % n]
                if len(sel):
                    tables.put(self.key("direct", (me + j) % n), sel)
        elif self.strategy != "pass-q" and n > 1:
            tables.put(self.key("send"), self.me.send)
        tables.meta[self.key("ready")] = True
        return tables

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timings: list | None = None,
            scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [Lq, H, D], k [Lkv, Hkv, D], v [Lkv, Hkv, Dv] (this rank's) → out [Lq, H, Dv] in q's dtype; `scale`
        overrides;
        sinks [H]: each head's sink logit, merged once into every query's softmax after the ring."""
        self.prepare(HeadLayout.of(q, k), q.device).upload()  # nothing pending when the caller prepared it
        scale = scale if scale is not None else q.shape[-1] ** -0.5 if self.scale is None else self.scale
        if self.strategy == "pass-q":
            return (pass_q.run_direct if self.direct else pass_q.run)(self, q, k, v, scale, timings, sinks)
        if self.strategy == "all-gather":
            return pass_kv.run_all_gather(self, q, k, v, scale, timings, sinks)
        return (pass_kv.run_direct if self.direct else pass_kv.run)(self, q, k, v, scale, timings, sinks)


def _relevant_rows(q_labels: np.ndarray, kv_seq: np.ndarray, kv_end: np.ndarray) -> np.ndarray:
    """Rows of K/V whose interval [kv_seq, kv_end) holds some query's label (q_labels sorted, unique, >= 0)."""
    at = np.searchsorted(q_labels, kv_seq, side="left")  # first label >= kv_seq
    hit = at < len(q_labels)
    hit[hit] = q_labels[at[hit]] < kv_end[hit]
    return np.nonzero(hit & (kv_seq >= 0))[0].astype(np.int64)


def plan_from_metadata(q_meta, kv_meta, *, group, rank: int, world: int, strategy: str,
                       scale: float | None = None, backend: str = "auto", window: int | None = None,
                       chunk: int | None = None, values_in_keys: bool = False) -> CPAttentionPlan:
    """Build a plan from every rank's metadata, known on all ranks: no communication.

    q_meta[r] = (q_seq, q_pos) and kv_meta[r] = (kv_seq, kv_pos) or (kv_seq, kv_pos, kv_seq_end) as int64 arrays,
    for r in range(world); a missing kv_seq_end means kv_seq + 1 (same sequence id). With a sliding `window` or an
    attention `chunk` pass-KV and pass-Q use the direct schedule (`Routes`): only rows some query can see travel,
    and a step with nothing to move for any rank sends no message. `values_in_keys`: every rank's v is the view
    k[..., :Dv] (MLA), so K/V messages carry the keys alone.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    problem = window_problem(window) or window_problem(chunk, "chunk")
    if problem:
        raise ValueError(problem)
    q_meta = [(np.asarray(s, dtype=np.int64), np.asarray(p, dtype=np.int64)) for s, p in q_meta]
    kv_meta = [_kv_triple(m) for m in kv_meta]
    q_meta, kv_meta = chunk_labels(q_meta, kv_meta, chunk)  # the chunk rule as labels, the same on every rank
    labels = np.unique(np.concatenate([s for s, _ in q_meta])) if q_meta else np.zeros(0, np.int64)
    labels = labels[labels >= 0]
    metas = [RankMeta(qs, qp, ks, kp, _relevant_rows(labels, ks, ke), ke)
             for (qs, qp), (ks, kp, ke) in zip(q_meta, kv_meta)]
    routes = None
    if (window is not None or chunk is not None) and strategy != "all-gather":
        routes = pair_routes(metas, "q" if strategy == "pass-q" else "kv", window)
    plan = CPAttentionPlan(group, rank, world, strategy, scale, metas, [], max(len(m.q_seq) for m in metas),
                           max(len(m.send) for m in metas), backend, window, routes, chunk=chunk,
                           values_in_keys=bool(values_in_keys))
    covered = np.zeros(len(plan.me.q_seq), dtype=bool)
    stair = min_stair(backend)
    for j in range(world):
        q_seq, q_pos, kv_seq, kv_end, kv_pos = plan.step_vectors(j)
        items = build_items(q_seq, q_pos, kv_seq, kv_pos, kv_end, window, stair)
        if strategy == "pass-q":  # source's queries against my stationary K/V; one accumulator per source
            plan.steps.append(mark_first(items, len(q_seq)))
        else:  # my queries against my own K/V (read in place) or the source's packed K/V
            plan.steps.append(mark_first(items, len(covered), covered))
    return plan


_RULES = {"window": "keys with q_pos - kv_pos >= window are invisible",
          "chunk": "keys with kv_pos // chunk != q_pos // chunk are invisible"}


def window_problem(window, what: str = "window") -> str:
    """What is wrong with a `window` (or `chunk`) argument, or '' (None or a positive int is fine)."""
    if window is None:
        return ""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window <= 0:
        return f"{what} must be a positive integer ({_RULES[what]}) or None, got {window!r}"
    return ""


def sinks_problem(sinks, heads: int) -> str:
    """What is wrong with a `sinks` argument for `heads` query heads, or ''."""
    if sinks is None:
        return ""
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not sinks.is_floating_point():
        return f"sinks must be a 1-D floating tensor [query heads], got {getattr(sinks, 'dtype', type(sinks))} " \
               f"{tuple(getattr(sinks, 'shape', ()))}"
    if sinks.shape[0] != heads:
        return f"sinks has {sinks.shape[0]} entries but q has {heads} heads; one sink logit per query head"
    return ""


def _kv_triple(m) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(m) not in (2, 3):
        raise ValueError(f"kv_meta entries must be (kv_seq, kv_pos) or (kv_seq, kv_pos, kv_seq_end), got {len(m)}")
    ks, kp = np.asarray(m[0], dtype=np.int64), np.asarray(m[1], dtype=np.int64)
    return ks, kp, seq_end_or_default(ks, m[2] if len(m) == 3 else None)


# ---------------------------------------------------------------- validation and metadata exchange

def _local_problem(q, k, v, q_seq, q_pos, kv_seq, kv_pos, strategy, scale, kv_seq_end=None,
                   backend="auto", window=None, chunk=None, sinks=None) -> str:
    """A description of what is wrong with this rank's inputs, or '' if nothing is."""
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}"
    if window_problem(window) or window_problem(chunk, "chunk"):
        return window_problem(window) or window_problem(chunk, "chunk")
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
    if k.shape[:2] != v.shape[:2] or v.shape[2] == 0:
        return (f"k and v must have the same tokens and heads (the value head size may differ), got {tuple(k.shape)} "
                f"and {tuple(v.shape)}")
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
    return sinks_problem(sinks, q.shape[1])


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
                      kv_seq_end=None, backend="auto", control_group=None, window=None, chunk=None,
                      sinks=None) -> CPAttentionPlan:
    """Validate on every rank, agree on errors, all-gather metadata, then build the plan.

    control_group: a gloo group over the same ranks for the metadata (default: `group` itself)."""
    tensors_group, group = group, control_group if control_group is not None else group
    rank, world = group_rank_and_size(tensors_group)
    if group_rank_and_size(group) != (rank, world):
        raise ValueError(f"control_group must hold the same ranks in the same order as group: this rank is "
                         f"{group_rank_and_size(group)} there and {(rank, world)} in group")
    problem = _local_problem(q, k, v, q_seq, q_pos, kv_seq, kv_pos, strategy, scale, kv_seq_end, backend, window,
                             chunk, sinks)
    ok = not problem
    shared = values_in_keys(k, v) if ok else None
    header = torch.tensor([0 if ok else 1,
                           q.shape[0] if ok else 0, k.shape[0] if ok else 0,
                           q.shape[1] if ok else 0, k.shape[1] if ok else 0, q.shape[2] if ok else 0,
                           _DTYPES.index(q.dtype) if ok else -1, STRATEGIES.index(strategy) if ok else -1,
                           (window or 0) if ok else -1, (chunk or 0) if ok else -1, v.shape[2] if ok else 0,
                           -1 if shared is None else int(shared)], dtype=torch.int64)
    headers = torch.stack(_all_gather_ints(header, group))  # [world, 12]
    if headers[:, 0].any():
        problems = [None] * world
        dist.all_gather_object(problems, problem, group=group)
        bad = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        raise ValueError(f"cp_attention: bad input on {bad}")
    for col, what in ((3, "query heads"), (4, "key/value heads"), (5, "head_dim"), (6, "dtype"), (7, "strategy"),
                      (8, "window"), (9, "chunk"), (10, "value head size")):
        if (headers[:, col] != headers[0, col]).any():
            raise ValueError(f"cp_attention: ranks disagree on {what}: {headers[:, col].tolist()}")
    known = headers[:, 11][headers[:, 11] >= 0]
    if len(known) and (known != known[0]).any():
        raise ValueError(f"cp_attention: ranks disagree on whether v is the view k[..., :Dv] (1) or its own tensor "
                         f"(0): {headers[:, 11].tolist()}")
    max_q, max_kv = int(headers[:, 1].max()), int(headers[:, 2].max())
    mine = torch.full((5, max(max_q, max_kv)), -1, dtype=torch.int64)
    mine[0, :q.shape[0]], mine[1, :q.shape[0]] = q_seq.cpu(), q_pos.cpu()
    mine[2, :k.shape[0]], mine[3, :k.shape[0]] = kv_seq.cpu(), kv_pos.cpu()
    mine[4, :k.shape[0]] = kv_seq.cpu() + 1 if kv_seq_end is None else kv_seq_end.cpu()
    gathered = _all_gather_ints(mine, group)
    q_meta = [(g[0, :h[1]].numpy(), g[1, :h[1]].numpy()) for g, h in zip(gathered, headers)]
    kv_meta = [(g[2, :h[2]].numpy(), g[3, :h[2]].numpy(), g[4, :h[2]].numpy()) for g, h in zip(gathered, headers)]
    return plan_from_metadata(q_meta, kv_meta, group=tensors_group, rank=rank, world=world, strategy=strategy,
                              scale=scale, backend=backend, window=window, chunk=chunk,
                              values_in_keys=bool(len(known) and known[0] == 1))
