"""DeepSeek sparse attention on the static decode path (`decode_graph.py`): the top-k selection inside the static
step, at fixed shapes a CUDA graph can capture (DESIGN: "Sparse attention is exact by gathering candidates").

The host lists, for every decode or verify row of the step, the key slots this rank holds for the row's sequence
(its cached slots, then its new tokens when they are here) with their positions, padded with the sink slot at an
unreachable position to a bound of `keys` per row that every rank computes alike from the batch. Per layer the
selection is `sparse_attention.py`'s, without a data-dependent shape: the ring's rows (with their indexer queries
and weights) are all-gathered, every rank scores its listed keys for every row, causally (a verify row at its own
position), keeps its local top-k in the order (score desc, position asc) — one `topk` for the k-th value, its ties
by position, the chosen taken in position order by a second `topk` — the ranks all-gather those candidates, the
k-th of their union selects, each rank attends over its selected latent rows and the partials return by All2All
to merge by LSE. A rank's local rows do the same alone. GLM's "shared" layers reuse the last selection.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.merge import merge_partials
from cpinfer.attention.sparse import attend_selected, ordered_topk, selected, threshold

FAR = np.iinfo(np.int64).max // 2  # the position of a padding key: after every query, so never visible
MIN_KEYS = 64  # the smallest per-row key bound (bounds grow in powers of two: few buckets)


def static_topk(scores: torch.Tensor, pos: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention/sparse.ordered_topk` with a key list per row (pos [Q, K]) and no data-dependent shape."""
    return ordered_topk(scores, pos, k, static=True)


class StaticSparse:
    """The static path's DSA attention: `fields` / `fill` on the host, `attention` per layer on the device."""

    def __init__(self, decode, topk: int):
        self.decode, self.topk = decode, topk
        self.last = {}  # part -> (selected slots [Q, k], keep [Q, k]) of the last full layer ("shared" layers)

    # ------------------------------------------------------------------ host side
    def keys_bound(self, batch, world: int) -> int:
        """The per-row key bound of this batch, the same on every rank: a power of two >= MIN_KEYS over every
        rank's keys of any sequence (its cached slots there plus its new tokens if there)."""
        most = max((sum(int(e - a) for a, e in s.ctx_runs[r]) + (len(s.token_ids) if int(s.ranks[0]) == r else 0)
                    for s in batch.seqs for r in range(world)), default=1)
        return max(MIN_KEYS, 1 << (max(most, 1) - 1).bit_length())

    @staticmethod
    def fields(ring_rows: int, local_rows: int, world: int, keys: int) -> list:
        """Static buffers: per part ("ring": every rank's ring rows, gathered; "local"), each row's query position
        and its key slots and positions [rows, keys]."""
        out = []
        for part, rows in (("ring", world * ring_rows), ("local", local_rows)):
            out += [(("dsa", part, "qpos"), np.int64, rows), (("dsa", part, "slots"), np.int64, rows * keys),
                    (("dsa", part, "kpos"), np.int64, rows * keys)]
        return out

    def fill(self, buf, batch, step, keys: int) -> None:
        """The rows' key lists of this step, `keys` per row (the bucket's bound)."""
        d, ring_of, local = self.decode, step.ring_of, step.local
        me, w, sink = d.rank, step.width, d.runner.store.sink
        pos_of = d.runner.slot_positions.pos[me]
        parts = [("ring", [(r * step.ring_rows + i, b) for r in range(d.world) for i, b in enumerate(ring_of[r])],
                  d.world * step.ring_rows * w)] if step.ring_rows else []
        parts += [("local", list(enumerate(local)), step.local_rows * w)] if step.local_rows else []
        for part, groups, rows in parts:
            qpos, slots, kpos = (buf.host(("dsa", part, f)) for f in ("qpos", "slots", "kpos"))
            qpos[:rows], slots[:rows * keys], kpos[:rows * keys] = 0, sink, FAR
            slots, kpos = slots[:rows * keys].reshape(rows, keys), kpos[:rows * keys].reshape(rows, keys)
            for g, b in groups:
                s = batch.seqs[b]
                cached = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in s.ctx_runs[me]] or
                                        [np.zeros(0, dtype=np.int64)])
                new = int(s.ranks[0]) == me  # (a decode or verify sequence's new tokens sit on one rank)
                sl = np.concatenate((cached, s.slots)) if new else cached
                kp = np.concatenate((pos_of[cached], s.start + np.arange(len(s.token_ids)))) if new else \
                    pos_of[cached]
                order = np.argsort(kp, kind="stable")
                for t in range(s.sampled_rows):
                    row = g * w + t
                    qpos[row] = s.start + t
                    slots[row, :len(sl)], kpos[row, :len(sl)] = sl[order], kp[order]

    # ------------------------------------------------------------------ device side
    def attention(self, bucket: dict, q, keys, store_index, index, scale: float, dv: int) -> torch.Tensor:
        """q [ring rows + local rows, H, D] (absorbed), keys [capacity + 1, D] (latent rows, this step's written),
        store_index [capacity + 1, Di], index: the layer's `IndexerRows` (None: "shared") -> out [rows, H, dv]."""
        nr, outs = bucket["ring_rows"], []
        if nr:
            outs.append(self._ring(bucket, q[:nr], keys, store_index, index, scale, dv))
        if bucket["local_rows"]:
            part = self._select(bucket, "local", q[nr:], store_index, index, slice(nr, None))
            if part is not None:
                keep = selected(*part[:2], *threshold(part[0], part[1], self.topk))
                self.last["local"] = (part[2], keep)
            sel, keep = self.last["local"]
            out, _ = attend_selected(q[nr:], keys, sel, keep, dv, scale)
            outs.append(out.to(q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _select(self, bucket, part: str, q, store_index, index, rows, iq=None, w=None):
        """My candidates for the part's rows: (values [Q, k], positions [Q, k], selected slots [Q, k]); None on a
        "shared" layer."""
        if index is None:
            return None
        buf = bucket["buffers"]
        n = q.shape[0]
        slots = buf[("dsa", part, "slots")].view(n, -1)  # [Q, keys]
        kpos = buf[("dsa", part, "kpos")].view(n, -1)
        qpos = buf[("dsa", part, "qpos")]
        iq = index.q[rows] if iq is None else iq  # [Q, Hi, Di]
        w = index.w[rows] if w is None else w  # [Q, Hi]
        k = store_index.index_select(0, slots.reshape(-1)).view(n, slots.shape[1], -1).float()  # [Q, keys, Di]
        s = torch.relu(torch.matmul(iq.float(), k.transpose(1, 2)) * index.scale)  # [Q, Hi, keys]
        scores = torch.matmul(w.float().unsqueeze(1), s).squeeze(1)  # [Q, keys]
        scores = scores.masked_fill(kpos > qpos[:, None], -torch.inf)  # causal (padding: never visible)
        vals, pos, idx = static_topk(scores, kpos, self.topk)
        return vals, pos, slots.gather(1, idx)

    def _ring(self, bucket, q, keys, store_index, index, scale, dv) -> torch.Tensor:
        """The ring's rows: gather every rank's, select by exchanging candidates, attend to my selected keys, the
        partials back to the rows' ranks, merged -> out [ring rows, H, dv]."""
        d, world = self.decode, self.decode.world
        rows, h, dq = q.shape
        parts = [q.reshape(rows, h * dq).float()]
        if index is not None:
            hi, di = index.q.shape[1], index.q.shape[2]
            parts += [index.q[:rows].reshape(rows, hi * di).float(), index.w[:rows].float()]
        mine = torch.cat(parts, dim=1)  # [rows, W]
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=d.group)
        every = torch.cat(got)  # [world * rows, W]
        gq = every[:, :h * dq].view(-1, h, dq).to(q.dtype)
        if index is not None:
            giq, gw = every[:, h * dq:h * dq + hi * di].view(-1, hi, di), every[:, h * dq + hi * di:]
            vals, pos, sel = self._select(bucket, "ring", gq, store_index, index, None, giq, gw)
            cand = torch.stack((vals.double(), pos.double()), dim=-1)  # [world * rows, k, 2]
            theirs = [torch.empty_like(cand) for _ in range(world)]
            dist.all_gather(theirs, cand, group=d.group)
            union = torch.cat(theirs, dim=1)  # [world * rows, world * k, 2]
            ts, tp = threshold(union[..., 0].float(), union[..., 1].long(), self.topk)
            self.last["ring"] = (sel, selected(vals, pos, ts, tp))
        sel, keep = self.last["ring"]
        out, lse = attend_selected(gq, keys, sel, keep, dv, scale)
        partials = torch.cat((out, lse[..., None]), dim=-1)  # [world * rows, H, dv + 1]
        back = torch.empty_like(partials)
        dist.all_to_all_single(back, partials, group=d.group)  # back[s * rows + i]: my row i's partial from rank s
        back = back.view(world, rows, h, dv + 1)
        merged, _ = merge_partials([back[s, ..., :dv] for s in range(world)], [back[s, ..., dv] for s in range(world)])
        return merged.to(q.dtype)


__all__ = ["StaticSparse", "static_topk"]
