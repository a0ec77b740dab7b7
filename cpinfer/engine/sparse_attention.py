"""DeepSeek sparse attention under CP, exact: each query row reads the top-k keys its lightning indexer scores highest
(`model/indexer.py`), chosen among every rank's keys by exchanging candidates, never keys (DESIGN: "Sparse
attention is exact by gathering candidates").

Per forward and DSA layer, for the sequences that spread over ranks (the ring's): every rank gets every rank's query
rows (the absorbed MLA query, the indexer query and weights: one all-gather), scores the keys it owns (its cached
slots and its new tokens, indexer keys read from the store beside the latent) for each row, keeps its local top-k in
the order (score desc, position asc), and the ranks all-gather only those (score, position) candidates — per row at
most CP x top-k, whatever the context length. The k-th of their union (`attention/sparse.py`: the threshold) is
the same on every rank and at every CP size; each rank attends to the selected keys it owns, and the partials go
back to the rows' ranks (one All2All) to merge by LSE. Sequences held by one rank do all of it there, with no
message. A "shared" layer (GLM) reuses the previous layer's selection.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.merge import merge_partials
from cpinfer.attention.sparse import attend_selected, ordered_topk, selected, threshold
from cpinfer.model.indexer import index_scores

_SCORE_ELEMS = 1 << 24  # rows x keys scored at once (memory of one chunk of the indexer's scores)


class _Part:
    """One sequence's query rows against the keys this rank owns: rows (into the layer's row space) [Q], their
    positions [Q], my key slots [K] and positions [K] (increasing)."""

    def __init__(self, rows, q_pos, slots, k_pos, device):
        order = np.argsort(k_pos, kind="stable")
        t = (lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64), device=device))
        self.rows, self.q_pos = t(rows), t(q_pos)
        self.slots, self.k_pos = t(np.asarray(slots)[order]), t(np.asarray(k_pos)[order])
        self.cand = None  # (values [Q, k], positions [Q, k], indices into my keys [Q, k]) of the last full layer
        self.keep = None  # [Q, k] bool: which of them are in the row's global top-k


class SparseAttention:
    """One rank's DSA attention for a forward, over the plan `BatchAttention` made of the batch; `run` per layer."""

    def __init__(self, plan, slot_positions, topk: int, device):
        self.plan, self.topk, self.device = plan, topk, device
        self.decode_k = self.decode_index = None  # (FP8 cache: set per layer by `run`)
        me, seqs = plan.rank, plan.batch.seqs
        self.ring = []
        for b in plan.ring:  # rows: rank r's ring row i is row r * max_q + i of the gathered rows
            rows = np.concatenate([r * plan.max_q + plan.qoff[r, b] + np.arange(plan.counts[r, b])
                                   for r in range(plan.world)])
            q_pos = np.concatenate([plan.pos[r][b] for r in range(plan.world)])
            self.ring.append(self._part(seqs[b], me, rows, q_pos, slot_positions))
        self.local = []
        for b in plan.local:
            rows = plan.qoff[me, b] + np.arange(plan.counts[me, b])
            self.local.append(self._part(seqs[b], me, rows, plan.pos[me][b], slot_positions))

    def _part(self, s, me, rows, q_pos, slot_positions) -> _Part:
        cached = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in s.ctx_runs[me]] or
                                [np.zeros(0, dtype=np.int64)])
        new = np.nonzero(s.ranks == me)[0]
        slots = np.concatenate((cached, s.slots[new]))
        k_pos = np.concatenate((slot_positions.pos[me, cached], s.start + new))
        return _Part(rows, q_pos, slots, k_pos, self.device)

    # ------------------------------------------------------------------ per layer
    def run(self, q, store_k, store_index, index, scale: float, dv: int, decode_k=None,
            decode_index=None) -> torch.Tensor:
        """q [Lq, H, D] (absorbed MLA queries), store_k [capacity, 1, D] (latent rows, this forward's written),
        store_index [capacity, Di] (indexer keys, written), index: this layer's `IndexerRows` (None: a "shared"
        layer, the previous selection) -> out [Lq, H, dv]. An FP8 cache: `decode_k` (latent rows [N, D] uint8 ->
        [N, D]) and `decode_index` (stored indexer keys -> [N, Di]) dequantize the rows read, never the store."""
        plan = self.plan
        self.decode_k, self.decode_index = decode_k, decode_index
        out = q.new_zeros((q.shape[0], q.shape[1], dv))
        keys = store_k[:, 0]  # [capacity, D]
        if self.ring:
            lr = int(plan.nq_ring[plan.rank])
            out[:lr] = self._run_ring(q, keys, store_index, index, scale, dv, lr).to(q.dtype)
        for part in self.local:
            if index is not None:
                self._candidates(part, index.q, index.w, store_index, index.scale)
                part.keep = selected(*part.cand[:2], *threshold(part.cand[0], part.cand[1], self.topk))
            o, _ = self._attend(part, q[part.rows], keys, dv, scale)
            out[part.rows] = o.to(q.dtype)
        return out

    def _attend(self, part: _Part, q, keys, dv: int, scale: float):
        """The part's rows q [Q, H, D] over their selected keys here -> (out [Q, H, dv], lse [Q, H]) fp32; a rank
        holding none of the sequence's keys gives empty partials (lse -inf)."""
        if not len(part.slots):
            return attend_selected(q, keys, part.cand[2][:, :0], part.keep[:, :0], dv, scale, self.decode_k)
        return attend_selected(q, keys, part.slots[part.cand[2]], part.keep, dv, scale, self.decode_k)

    def _candidates(self, part: _Part, iq, w, store_index, scale: float) -> None:
        """My local top-k of each of the part's rows: (values, positions, indices into my keys), [Q, k] each."""
        k = store_index[part.slots]  # [K, Di]
        if self.decode_index is not None:
            k = self.decode_index(k)
        vals, pos, idx = [], [], []
        step = max(1, _SCORE_ELEMS // max(1, len(part.slots) * iq.shape[1]))  # [rows, Hi, K] at once
        for a in range(0, len(part.rows), step):
            rows = part.rows[a:a + step]
            s = index_scores(iq[rows], w[rows], k, scale)  # [c, K]
            s = s.masked_fill(part.k_pos[None, :] > part.q_pos[a:a + step, None], -torch.inf)  # causal
            v, p, i = ordered_topk(s, part.k_pos, self.topk)
            vals.append(v), pos.append(p), idx.append(i)
        cat = (lambda xs, like: torch.cat(xs) if xs else like)
        empty_v = torch.zeros((0, self.topk), dtype=torch.float32, device=self.device)
        empty_i = torch.zeros((0, self.topk), dtype=torch.int64, device=self.device)
        part.cand = (cat(vals, empty_v), cat(pos, empty_i), cat(idx, empty_i))

    def _run_ring(self, q, keys, store_index, index, scale, dv, lr) -> torch.Tensor:
        """The ring's sequences: gather every rank's rows, select (exchanging candidates), attend to my selected
        keys, return the partials to the rows' ranks and merge them -> out [lr, H, dv] fp32."""
        plan, world, rows = self.plan, self.plan.world, self.plan.max_q
        group = plan.group
        h, d = q.shape[1], q.shape[2]
        parts = [q[:lr].reshape(lr, h * d).float()]
        if index is not None:
            hi, di = index.q.shape[1], index.q.shape[2]
            parts += [index.q[:lr].reshape(lr, hi * di).float(), index.w[:lr].float()]
        mine = torch.cat(parts, dim=1)  # [lr, W]: this rank's ring rows, packed
        send = mine.new_zeros((rows, mine.shape[1]))
        send[:lr] = mine
        got = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(got, send, group=group)
        allrows = torch.cat(got)  # [world * max_q, W]
        gq = allrows[:, :h * d].view(-1, h, d).to(q.dtype)
        if index is not None:
            giq = allrows[:, h * d:h * d + hi * di].view(-1, hi, di)
            gw = allrows[:, h * d + hi * di:]
            for part in self.ring:
                self._candidates(part, giq, gw, store_index, index.scale)
            self._exchange(world * rows)
        partials = torch.zeros((world * rows, h, dv + 1), dtype=torch.float32, device=q.device)  # out | lse
        partials[..., dv] = -torch.inf
        for part in self.ring:
            o, l = self._attend(part, gq[part.rows], keys, dv, scale)
            partials[part.rows, :, :dv], partials[part.rows, :, dv] = o, l
        back = torch.empty_like(partials)
        dist.all_to_all_single(back, partials, group=group)  # back[s * max_q + i]: my row i's partial from rank s
        back = back.view(world, rows, h, dv + 1)[:, :lr]
        out, _ = merge_partials([back[s, ..., :dv] for s in range(world)], [back[s, ..., dv] for s in range(world)])
        return out

    def _exchange(self, n_rows: int) -> None:
        """All-gather every rank's candidates (score, position) of every ring row; each part's `keep` from the
        rows' thresholds, the same on every rank."""
        plan, k = self.plan, self.topk
        cand = torch.full((n_rows, k, 2), -torch.inf, dtype=torch.float64, device=self.device)
        cand[..., 1] = -1
        for part in self.ring:
            cand[part.rows, :, 0] = part.cand[0].double()
            cand[part.rows, :, 1] = part.cand[1].double()
        got = [torch.empty_like(cand) for _ in range(plan.world)]
        dist.all_gather(got, cand, group=plan.group)
        every = torch.cat(got, dim=1)  # [n_rows, world * k, 2]
        ts, tp = threshold(every[..., 0].float(), every[..., 1].long(), k)  # [n_rows] each
        for part in self.ring:
            part.keep = selected(part.cand[0], part.cand[1], ts[part.rows], tp[part.rows])


def check_engine(config, args, role: str | None = None) -> None:
    """Refuse, before any rank starts, what a DSA model cannot run with here (the indexer keys travel only where
    this names nothing): `args` an `EngineConfig`, `role` a P/D group's role (None: a plain engine)."""
    if config.dsa is None:
        return
    name = f"{config.model_type} (DeepSeek sparse attention)"
    refused = [
        (args.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"), f"kv_cache_dtype={args.kv_cache_dtype!r}",
         "kv_cache_dtype 'auto' or 'fp8' (static scales, as MLA)"),
        (args.mla_form == "expanded", "mla_form='expanded'", "mla_form 'auto' or 'absorbed' (each query reads its "
         "top-k latent rows absorbed)"),
    ]
    for bad, what, use in refused:
        if bad:
            raise ValueError(f"{what} is not supported for {name}: use {use}")


__all__ = ["SparseAttention", "check_engine"]
