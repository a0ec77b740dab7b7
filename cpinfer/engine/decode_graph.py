"""Decode under CUDA graphs (paper §4.3): the decode forward with static shapes, one per batch-size bucket.

A decode forward's shapes depend only on how many of the ring's tokens the busiest rank holds, so every rank pads
them to the same bucket (1, 2, 4, 8, then multiples of 8), and its own local sequences' tokens (all their keys on
this rank, no communication) to a bucket of its own. Static device buffers hold the token ids, positions and KV slots
(padding rows write a spare slot) and, per ring step and per distinct (window, chunk), a fixed-size item-mode tile
table of the Triton step kernel: its loop bounds are read on the device, so the grid never changes (split-KV with
a fixed number of pieces per row). The host fills a pinned mirror of them and copies it with one non-blocking
transfer per step. On CUDA the forward — the layers, pass-Q decode's ring, All2All and merge (Alg. 4), the logits
of the bucket's rows — is captured once per bucket (after an eager warm-up, in a memory pool the buckets share)
and replayed; with `enforce_eager`, on CPU or over gloo the same static forward runs eagerly. Speculative decoding's
verify sequences (k + 1 rows on one rank) are groups of `width` rows, one program reading the keys once for all of
them, each row with its own causal bound (docs/gpu.md, "Verify rows"); buckets per (sequences, width). MLA (values = the
latent keys' first channels, Dv < Dk) runs the one-head-size kernel with the keys as values and keeps the output's
first Dv channels. DeepSeek sparse attention (DSA) selects each row's top-k keys inside the static step
(`sparse_decode.py`) instead of the kernel's tile tables.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from cpinfer import timing
from cpinfer.attention.items import new_accumulator
from cpinfer.attention.merge import finish, merge_sink
from cpinfer.attention.tiles import TABLE_FIELDS
from cpinfer.cp.ring import ring_steps
from cpinfer.engine.attention import _merge_runs, first_visible
from cpinfer.engine.batch import ForwardBatch
from cpinfer.engine.decode_tables import StaticBuffers, bucket_sizes, split_rows, verify_runs
from cpinfer.engine.static_recurrent import StaticRecurrence, slot_rows
from cpinfer.engine.sparse_decode import StaticSparse

MODES = ("off", "eager", "graph")  # no static path; the static path run eagerly; captured as CUDA graphs


@dataclasses.dataclass
class DecodeStep:
    """The host side of one decode forward on this rank (built from the batch, identical logic on every rank).

    Its rows: first the ring's (sequences whose keys span ranks: every rank pads them to `ring_rows`), then this
    rank's local ones (all their keys here: padded to `local_rows`, no communication)."""

    ring_rows: int  # the ring's bucket of sequences (0: no ring in this forward, no collective)
    local_rows: int  # this rank's local bucket of sequences
    mine: list[int]  # sequences whose tokens this rank holds, in group order (ring ones, then local ones)
    n_ring: int  # how many of `mine` are the ring's
    tables: dict  # ("ring", step j, (window, chunk)) / ("local", 0, (window, chunk)) -> split rows against my store
    ranges: int  # a bound on any rank's table ranges (the same on every rank: they resize buckets together)
    width: int = 1  # query rows per sequence: 1, or k + 1 of the widest verify sequence (every rank the same)
    rec_rows: int = 0  # hybrid models: rows per rank of the recurrent layers' exchange (every rank the same)
    rec_groups: list | None = None  # ... and each rank's sequences in its row order (None: padding)
    keys: int = 0  # DSA: the per-row key bound (every rank the same; `sparse_decode.py`)
    ring_of: list | None = None  # DSA: every rank's ring sequences in group order
    local: list | None = None  # DSA: my local sequences

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.ring_rows, self.local_rows, self.width, self.rec_rows


class StaticDecode:
    """The runner's static-shape decode path: `handles(batch)`, then `execute(batch)` → (my sequences in row order,
    their logits [rows, vocab] fp32 on the device)."""

    def __init__(self, runner, mode: str, max_rows: int, pieces: int | None = None, verify: str = "decode",
                 verify_widths: tuple[int, ...] | None = None):
        if mode not in ("eager", "graph"):
            raise ValueError(f"the static decode path runs 'eager' or 'graph', got {mode!r}")
        from cpinfer.attention import triton_attention, triton_merge  # the kernels (Triton is optional)

        self.kernels, self.merge = triton_attention, triton_merge.triton_merge
        self.runner, self.mode, self.max_rows, self.pieces = runner, mode, max_rows, pieces
        self.verify = verify  # "decode": verify sequences' k + 1 rows run here too; "prefill": never
        # the widths (k + 1) a verify forward's groups are padded up to, one bucket (graph) each; None: any width
        self.verify_widths = None if verify_widths is None else tuple(sorted(verify_widths))
        if runner.store.sink >= 2 ** 30:  # slots sit in the kernel's int32 tables
            raise ValueError(f"the static decode path's int32 tables hold slots below 2^30; this rank has "
                             f"{runner.store.sink} (use enforce_eager=True or a smaller max_kv_tokens_per_rank)")
        self.device = runner.ctx.device
        self.rank, self.world = runner.groups.cp_rank, runner.groups.config.cp
        self.group = runner.groups.cp_group
        # the distinct (window, chunk) of the layers: a decode query sees its keys from first_visible on
        self.kinds = sorted(set(zip(runner.windows, runner.chunks)), key=lambda wc: (wc[0] or 0, wc[1] or 0))
        interp = triton_attention.interpreting()
        layout = runner.layout
        self.block_m = triton_attention.block_m_for(layout.heads // layout.kv_heads, 16)  # one row per program
        # key tiles of 64 rows, or 16 where the head is wide (MLA's 576-channel latent keys pad to 1024 lanes: K and
        # V tiles of 64 x 1024 would not fit a GPU's shared memory); not tuned on a GPU
        self.block_n = 16 if interp or runner.widths.key > 256 else 64
        # a verify group's rows x G heads in one program up to this many lanes (wide heads: no more than plain
        # decode's), its rows in blocks beyond; not tuned on a GPU
        self.max_lanes = max(128, self.block_m) if runner.widths.key <= 256 else self.block_m
        self.sizes = bucket_sizes(max_rows)
        dsa = runner.config.dsa
        self.sparse = None if dsa is None else StaticSparse(self, dsa.index_topk)  # DSA: top-k, no tile tables
        self.buckets: dict[tuple[int, int, int], dict] = {}  # (ring seqs, local seqs, width) -> buffers, graph
        self.pool = torch.cuda.graph_pool_handle() if mode == "graph" else None
        self.forwards = 0  # decode forwards this path served (diagnostics and tests)
        self.replays = 0  # ... of which by replaying a captured graph
        self.verify_forwards = 0  # ... of which with verify rows (speculative decoding)
        self.verify_fallbacks = 0  # decode forwards with verify rows this path left to the dynamic one
        # hybrid models: the recurrent layers, states updated in place (`static_recurrent.py`)
        self.recurrence = None if runner.states is None else StaticRecurrence(runner, self.rank, self.world,
                                                                              self.group)
        self.last_phases: dict = {}  # host seconds of the last forward: "plan" (its buffers), "model" (launch)

    # ------------------------------------------------------------------ host side
    def handles(self, batch: ForwardBatch) -> bool:
        """A pure decode forward (one sampled token per sequence, or a verify sequence's k + 1 rows, all on one rank)
        whose ring, if any, is pass-Q, fitting a bucket. Verify rows need `verify` "decode" and full-attention layers
        only (a window or chunk bound differs per row); a decode forward with verify rows left to the dynamic path
        is counted (`verify_fallbacks`), as one wider than the largest captured verify width."""
        if batch.phase != "decode" or (self.world > 1 and batch.strategy not in ("pass-q", "local")):
            return False
        if any(s.sample is None or s.prompt_logprobs or len(s.token_ids) != s.sampled_rows for s in batch.seqs):
            return False
        counts = np.bincount([int(s.ranks[0]) for s in batch.seqs], minlength=self.world)
        fits = int(counts.max()) <= self.max_rows
        if all(s.draft is None for s in batch.seqs):
            return fits
        if self.recurrence is not None:  # a hybrid's verify rows: the dynamic path keeps their per-token states
            self.verify_fallbacks += 1
            return False
        if fits and self.verify == "decode" and self.kinds == [(None, None)] and self._width(batch) and all(
                (s.ranks == s.ranks[0]).all() for s in batch.seqs):
            return True
        self.verify_fallbacks += 1
        return False

    def _spread(self, batch: ForwardBatch) -> list[bool]:
        """Per sequence: does it take part in the ring (its keys span ranks)? Never with one rank."""
        if self.world == 1 or batch.strategy == "local":
            return [False] * len(batch.seqs)
        return [bool(getattr(s, "spread", True)) for s in batch.seqs]

    def _width(self, batch: ForwardBatch) -> int:
        """Rows per sequence of this forward: its widest sequence's, padded up to a captured verify width (0: wider
        than every one of them)."""
        width = max(s.sampled_rows for s in batch.seqs)
        if width == 1 or self.verify_widths is None:
            return width
        return next((w for w in self.verify_widths if w >= width), 0)

    def plan(self, batch: ForwardBatch) -> DecodeStep:
        seqs, me, n = batch.seqs, self.rank, self.world
        width = self._width(batch)
        spread = self._spread(batch)
        ring_of = [[b for b, s in enumerate(seqs) if spread[b] and int(s.ranks[0]) == r] for r in range(n)]
        local = [b for b, s in enumerate(seqs) if not spread[b] and int(s.ranks[0]) == me]
        ring_rows = self._size(max(len(x) for x in ring_of))
        local_rows = self._size(len(local))
        visible = {}  # sequence -> its key runs on this rank (its cached runs, plus its new token(s) if here)
        for rows_of in ring_of + [local]:
            for i, b in enumerate(rows_of):
                s = seqs[b]
                runs = s.ctx_runs[me]
                if int(s.ranks[0]) != me:
                    visible[b] = _merge_runs(runs)
                elif s.draft is None:
                    visible[b] = _merge_runs(np.concatenate((runs, [[s.slots[0], s.slots[0] + 1]])))
                else:  # a verify sequence: [k0, k1, diag] runs, its rows from i * width of its part
                    visible[b] = verify_runs(_merge_runs(runs), s.slots, i * width)
        if self.sparse is not None:
            return DecodeStep(ring_rows, local_rows, ring_of[me] + local, len(ring_of[me]), {}, 0, width,
                              keys=self.sparse.keys_bound(batch, n), ring_of=ring_of, local=local)
        parts = [("ring", j, ring_of[(me - j) % n], ring_rows) for j in range(n if ring_rows else 0)]
        parts += [("local", 0, local, local_rows)] if local_rows else []
        tables = {}
        for part, j, rows_of, rows in parts:
            used = [seqs[b].sampled_rows for b in rows_of]
            for kind in self.kinds:
                runs = [visible[b] if kind == (None, None) else self.runner.slot_positions.recent_runs(
                    me, visible[b], first_visible(seqs[b].start, *kind)) for b in rows_of]
                tables[(part, j, kind)] = split_rows(runs, rows, self._pieces(rows), width, used,
                                                     self._rows_per_prog(width))
        # every rank can bound every rank's tables from the batch: a run per cached run and per new token, each
        # run cut at most pieces - 1 more times, and all once per row block of a group
        pieces = max(self._pieces(ring_rows), self._pieces(local_rows))
        blocks = -(-width // self._rows_per_prog(width))
        bound = (sum(max(len(r) for r in s.ctx_runs) + len(s.token_ids) for s in seqs) + len(seqs) * (pieces - 1)
                 ) * blocks
        assert all(len(t["k0"]) <= bound for t in tables.values())
        rec_rows, rec_groups = 0, None
        if self.recurrence is not None:  # every rank's rows: its ring ones (padded), then its local ones
            local_of = [[b for b, s in enumerate(seqs) if not spread[b] and int(s.ranks[0]) == r] for r in range(n)]
            rec_rows = ring_rows + max(self._size(len(x)) for x in local_of)
            rec_groups = [ring_of[r] + [None] * (ring_rows - len(ring_of[r])) + local_of[r] for r in range(n)]
        return DecodeStep(ring_rows, local_rows, ring_of[me] + local, len(ring_of[me]), tables, bound, width,
                          rec_rows, rec_groups)

    def _size(self, rows: int) -> int:
        """The bucket of `rows` rows (0 stays 0: that part is absent)."""
        return 0 if rows == 0 else next(b for b in self.sizes if b >= rows)

    def _rows_per_prog(self, width: int) -> int:
        """Rows of a group one program holds (all its k + 1 when their G heads each fit `max_lanes`)."""
        g = self.runner.layout.heads // self.runner.layout.kv_heads
        return max(1, min(width, self.max_lanes // g))

    def _pieces(self, rows: int) -> int:
        if self.pieces is not None:
            return self.pieces
        if self.device.type != "cuda" or rows == 0:
            return 1
        target = 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        return int(min(16, max(1, math.ceil(target / (rows * self.runner.layout.kv_heads)))))

    def _bucket(self, step: DecodeStep) -> dict:
        """The bucket for this step: made on first use, remade (bigger, recaptured) when a table outgrows it."""
        bucket = self.buckets.get(step.key)
        if bucket is None or bucket["ranges"] < step.ranges or bucket["keys"] < step.keys:
            cap = max(256, 1 << (2 * max(step.ranges, 1) - 1).bit_length())
            rows = (step.ring_rows + step.local_rows) * step.width
            fields = [(("ids",), np.int64, rows), (("pos",), np.int64, rows), (("slots",), np.int64, rows)]
            fields += [((f,), np.int64, self.world * step.rec_rows) for f in ("rec_in", "rec_out", "rec_copy")]
            keys = 2 * step.keys  # (DSA: room to grow before the bucket is remade)
            if self.sparse is not None:
                fields += self.sparse.fields(step.ring_rows * step.width, step.local_rows * step.width, self.world,
                                             keys)
            pieces = {}
            rpp = self._rows_per_prog(step.width)
            for key in step.tables:
                part_rows = step.ring_rows if key[0] == "ring" else step.local_rows
                pieces[key] = self._pieces(part_rows)
                programs = part_rows * -(-step.width // rpp) * pieces[key]
                fields += [(key + ("row0",), np.int32, programs), (key + ("row1",), np.int32, programs),
                           (key + ("off",), np.int32, programs + 1), (key + ("slot",), np.int32, programs)]
                fields += [(key + (f,), np.int32, cap) for f in ("k0", "k1", "r0", "r1", "diag")]
            g = self.runner.layout.heads // self.runner.layout.kv_heads
            bucket = {"buffers": StaticBuffers(fields, self.device), "ranges": cap, "pieces": pieces, "keys": keys,
                      "ring_rows": step.ring_rows * step.width, "local_rows": step.local_rows * step.width,
                      "width": step.width, "graph": None, "logits": None, "rec_rows": step.rec_rows,
                      "state_version": None,
                      # one program holds a block of a group's rows x G heads
                      "block_m": self.kernels.block_m_for(rpp * g, self.block_m)}
            self.buckets[step.key] = bucket  # a replaced bucket's graph and memory go with the old dict
        return bucket

    def _fill(self, bucket: dict, batch: ForwardBatch, step: DecodeStep) -> None:
        buf, seqs = bucket["buffers"], batch.seqs
        buf.wait()
        ring = step.mine[:step.n_ring] + [None] * (step.ring_rows - step.n_ring)  # group order, None: padding
        local = step.mine[step.n_ring:] + [None] * (step.local_rows - len(step.mine) + step.n_ring)
        w, sink = step.width, self.runner.store.sink
        ids, pos, slots = buf.host(("ids",)), buf.host(("pos",)), buf.host(("slots",))
        ids[:], pos[:], slots[:] = 0, 0, sink  # padding rows (and a group's rows past its sequence's) write the sink
        for i, b in enumerate(ring + local):
            if b is not None:
                s = seqs[b]
                t = len(s.token_ids)
                ids[i * w:i * w + t] = s.token_ids
                pos[i * w:i * w + t] = s.start + np.arange(t)
                slots[i * w:i * w + t] = s.slots
        if step.rec_groups is not None:
            states = self.runner.states
            for f, v in slot_rows(batch, step.rec_groups, step.rec_rows, states.zero, states.sink).items():
                buf.host((f,))[:] = v
        for key, table in step.tables.items():
            for f in TABLE_FIELDS + ("slot",):
                host = buf.host(key + (f,))
                host[:len(table[f])] = table[f]
                host[len(table[f]):] = 0
        if self.sparse is not None:
            self.sparse.fill(buf, batch, step, bucket["keys"])
        buf.upload()

    # ------------------------------------------------------------------ device side
    def execute(self, batch: ForwardBatch) -> tuple[list[int], torch.Tensor | None]:
        """→ (my sequences in row order, their logits [rows, vocab] fp32 on the device: one row per sequence, k + 1
        for a verify sequence); (`[]`, None) when this rank has nothing to do (no token of its own and no ring to
        serve)."""
        t0 = time.perf_counter()
        step = self.plan(batch)
        states = self.runner.states
        if states is not None:  # hybrid: every slot the batch names exists (a growth retires captured graphs)
            states.ensure(1 + max(max(s.state_in, s.state_out, s.state_copy) for s in batch.seqs))
        if step.ring_rows + step.local_rows == 0:
            if self.recurrence is not None and self.world > 1:  # no row here: the exchanges and replicas still
                bucket = self._bucket(step)
                self._fill(bucket, batch, step)
                with torch.inference_mode():
                    self.recurrence.bind(bucket["buffers"], step.rec_rows).replicate(self.runner.model)
            self.last_phases = {"plan": time.perf_counter() - t0}
            return [], None
        bucket = self._bucket(step)
        self.forwards += 1
        self._fill(bucket, batch, step)
        t1 = time.perf_counter()
        if states is not None and bucket["state_version"] != states.version:
            bucket["graph"], bucket["state_version"] = None, states.version  # captured over the old tensors
        if bucket["graph"] is not None:
            bucket["graph"].replay()
            self.replays += 1
            logits = bucket["logits"]
        else:
            logits = self.forward(bucket)  # eager (and, before a capture, the warm-up: this step's result)
            if self.mode == "graph":
                self._capture(bucket)
        self.last_phases = {"plan": t1 - t0, "model": time.perf_counter() - t1}
        nr, nl = step.n_ring, len(step.mine) - step.n_ring  # real groups: ring ones, then local ones after the pad
        if step.width > 1:  # each sequence's rows (k + 1 of a verify sequence, else 1), in order
            self.verify_forwards += 1
            groups = list(range(nr)) + list(range(step.ring_rows, step.ring_rows + nl))
            rows = [g * step.width + t for g, b in zip(groups, step.mine)
                    for t in range(batch.seqs[b].sampled_rows)]
            return step.mine, logits.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=logits.device))
        if nr == step.ring_rows or nl == 0:
            return step.mine, logits[:nr + nl] if nr == step.ring_rows else logits[:nr]
        return step.mine, torch.cat((logits[:nr], logits[step.ring_rows:step.ring_rows + nl]))

    def _capture(self, bucket: dict) -> None:
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with timing.paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            bucket["logits"] = self.forward(bucket)  # recorded, not run: this step already ran eagerly
        bucket["graph"] = graph

    def forward(self, bucket: dict) -> torch.Tensor:
        """The bucket's decode forward from its static buffers → logits [rows, vocab] fp32."""
        buf, store, r = bucket["buffers"], self.runner.store, self.runner

        in_keys = store.widths.values_in_keys
        key = store.widths.key

        def attn(layer: int, q, k, v, sinks=None, index=None):  # q [rows, H, Dk], k [rows, Hkv, Dk], v [rows, Hkv,
            # Dv]; sinks [H]; index: a DSA layer's `IndexerRows` (None on its "shared" layers)
            kind = (r.windows[layer], r.chunks[layer])
            layer = r.kv_layer[layer]  # its KV store layer (a hybrid's recurrent layers have none)
            if self.sparse is not None:  # rows [latent ; indexer key]; each row's top-k (`sparse_decode.py`)
                store.k[layer][..., :key].index_copy_(0, buf[("slots",)], k)
                if index is not None:
                    store.write_index(layer, buf[("slots",)], index.k)
                return self.sparse.attention(bucket, q, store.k[layer][:, 0, :key], store.index[layer], index,
                                             r.scale, v.shape[-1])
            store.k[layer].index_copy_(0, buf[("slots",)], k)
            if not in_keys:  # (MLA: v is the keys' first channels, written with them)
                store.v[layer].index_copy_(0, buf[("slots",)], v)
            if not in_keys:
                return self._attention(bucket, q, store.k[layer], store.v[layer], kind, sinks)
            # the kernel takes one head size: the whole keys stand for the values, whose P·v is the output's first
            # Dv channels (the rest, P·k_r, is dropped)
            return self._attention(bucket, q, store.k[layer], store.k[layer], kind, sinks)[..., :v.shape[-1]]

        recurrent = None if self.recurrence is None else self.recurrence.bind(buf, bucket["rec_rows"])
        with torch.inference_mode():
            hidden = r.model(buf[("ids",)], buf[("pos",)], attn, recurrent)  # [rows, hidden]
            return r.model.compute_logits(hidden)  # [rows, vocab] fp32

    def _attention(self, bucket: dict, q, k, v, kind, sinks) -> torch.Tensor:
        """q [ring rows + local rows, H, D] → out, same shape: the ring's rows by pass-Q decode over every rank,
        my local rows against my store alone; the sinks [H] (or None) merged once per row at the end."""
        nr = bucket["ring_rows"]
        outs = []
        if nr:
            outs.append(self._ring(bucket, q[:nr], k, v, kind, sinks))
        if bucket["local_rows"]:
            ql = q[nr:]
            acc_out, acc_lse = new_accumulator(ql.shape[0], ql.shape[1], ql.shape[2], q.device)
            self._launch(bucket, ("local", 0, kind), ql, k, v, acc_out, acc_lse)
            outs.append(finish(acc_out, acc_lse, sinks, q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _ring(self, bucket: dict, q, k, v, kind, sinks) -> torch.Tensor:
        """Pass-Q decode (Alg. 4) at fixed shapes: q [ring rows, H, D] around the ring, partials back by All2All."""
        n, (rows, h, d) = self.world, q.shape
        partials = torch.zeros(n, rows, h, d + 1, dtype=torch.float32, device=q.device)  # out | lse per source
        partials[..., d].fill_(-torch.inf)

        def compute(j, block):  # the queries of rank (rank - j) against my store
            part = partials[(self.rank - j) % n]
            self._launch(bucket, ("ring", j, kind), block, k, v, part[..., :d], part[..., d])

        ring_steps(self.group, q.contiguous(), n, compute)
        back = torch.empty_like(partials)
        dist.all_to_all_single(back, partials, group=self.group)  # back[s]: my queries' partial from rank s
        if sinks is None:
            return self.merge(back[..., :d], back[..., d], q.dtype)[0]
        out, lse = self.merge(back[..., :d], back[..., d], torch.float32)
        merge_sink(out, lse, sinks)
        return out.to(q.dtype)

    def _launch(self, bucket: dict, key, q, k, v, acc_out, acc_lse) -> None:
        buf, pieces = bucket["buffers"], bucket["pieces"][key]
        table = tuple(buf[key + (f,)] for f in TABLE_FIELDS)
        self.kernels.launch_step(q, k, v, acc_out, acc_lse, None, table, self.runner.scale, bucket["block_m"],
                                 self.block_n, slots=buf[key + ("slot",)] if pieces > 1 else None,
                                 n_slots=pieces if pieces > 1 else 0)
