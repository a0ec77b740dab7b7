"""The rank side (SPMD): one model replica and this rank's KV shard; runs each `ForwardBatch` as told.

`execute` reads as five steps: apply the batch's cache operations (K/V moving between the device, host and disk
tiers) → plan attention for the batch → run the model on this rank's new tokens (writing their K/V into the given
slots, then CP attention) → sample where the logits are → return token ids and the log-probabilities asked for. A rank with no token and no ring to serve skips the model. Only TP rank 0 of each CP
rank reports (every TP rank holds the same hidden states).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time

import numpy as np
import torch

from cpinfer import timing
from cpinfer.attention import autoselect
from cpinfer.attention.backends import resolve_name
from cpinfer.attention.cpu_kernels import decode_attention_op
from cpinfer.attention.items import new_accumulator
from cpinfer.attention.step import HeadLayout
from cpinfer.device import keep_freed_host_memory
from cpinfer.distributed import ParallelConfig, build_groups
from cpinfer.engine.attention import BatchAttention, SlotPositions
from cpinfer.engine.batch import ForwardBatch, RankResult, SampleResult
from cpinfer.engine.decode_graph import StaticDecode
from cpinfer.engine.kv import fp8 as kv_fp8
from cpinfer.engine.kv.capacity import MemoryProbe, kv_tokens_from_memory
from cpinfer.engine.kv.ops import FromHost, LoadEntry
from cpinfer.engine.kv.state_store import StateStore
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.engine.recurrent import RecurrentRunner
from cpinfer.engine.kv.tier_store import RankTiers, SharedRows
from cpinfer.engine.sampling import greedy_rows, plain_greedy, sample
from cpinfer.engine.sparse_attention import SparseAttention
from cpinfer.engine.spec_decode.rejection import row_specs, verify
from cpinfer.model import ModelConfig, load_model
from cpinfer.model.loader import random_model
from cpinfer.tensor_parallel import RowParallelLinear, head_ranges, load_tp_model
from cpinfer.utils import get_logger

log = get_logger()

_LOGIT_CHUNK = 1024  # rows per chunk when computing prompt log-probabilities


class ModelRunner:
    def __init__(self, ctx, model_path: str, dtype: torch.dtype, parallel: ParallelConfig,
                 attention_backend: str | None = None, decode: dict | None = None, kv_cache_dtype: str = "auto",
                 load_format: str = "auto", groups=None):
        """decode: {"mode": "off" | "eager" | "graph", "max_rows": int, "verify": "decode" | "prefill"} — the
        static-shape decode path (`decode_graph.py`), captured as CUDA graphs in "graph" mode, verify rows on it
        with "decode"; default off. kv_cache_dtype: "auto" (the
        compute dtype) or "fp8" (`kv/fp8.py`). load_format: "auto" (the checkpoint) or "dummy" (random weights
        made on the device, TP1: `loader.random_model`). groups: this rank's `ParallelGroups` when built already (a
        role of a prefill / decode world: `distributed.build_role_groups`), else built here over the world."""
        self.ctx = ctx
        self.kv_cache_dtype = kv_fp8.check_kv_cache_dtype(kv_cache_dtype)
        self.draft_probs: dict[str, torch.Tensor] = {}  # speculative decoding: request id → [k, vocab] the draft
        # model's probabilities of its drafts, left on this rank by its proposer for the verify step (engine/spec_decode)
        self.model_path = model_path
        self.kv_scales_source: str | None = None  # static FP8 KV: "checkpoint" or "calibrated" (`_kv_scales`)
        self.groups = groups if groups is not None else build_groups(parallel, ctx.rank, ctx.group)
        if load_format == "dummy":
            self.config = ModelConfig.from_pretrained(model_path)
            self.model = random_model(self.config, dtype, ctx.device)
        elif parallel.tp == 1:
            self.config, self.model = load_model(model_path, dtype=dtype, device=ctx.device)
        else:
            self.config = ModelConfig.from_pretrained(model_path)
            self.model = load_tp_model(model_path, self.config, parallel.tp, self.groups.tp_rank,
                                       self.groups.tp_group, dtype=dtype, device=ctx.device)
        self.dtype = dtype
        if ctx.device.type == "cpu":  # q / k / v and gate / up as one GEMM each (fewer, wider GEMMs; `model/fused.py`)
            keep_freed_host_memory()  # activations reused, not faulted in again at every forward (`device.py`)
            self.model.fuse_projections()
            self.model.pack_linears()  # cpinfer's kernel for 1-2 rows, oneDNN's packed weights above (`model/cpu_gemm.py`)
            if dtype == torch.float32:  # the batched decode kernel: built (once per machine) or loaded now, not in
                decode_attention_op()  # the first decode step (`attention/cpu_kernels.py`)
        attn = self.model.model.layers[self.config.attention_layers[0]].self_attn  # (a hybrid's first may be recurrent)
        self.n_kv = attn.num_kv_heads  # this TP rank's KV heads (MLA: the one latent head, on every TP rank)
        self.widths = KVWidths.of(self.config)
        self.layout = HeadLayout(attn.num_heads, self.n_kv, self.widths.key, dtype)  # what attention gets
        mla = self.config.mla if self.widths.values_in_keys else None  # MLA's expanded form: per-head K / V
        self.expanded_layout = None if mla is None else HeadLayout(attn.num_heads, attn.num_heads, mla.qk_head_dim,
                                                                   dtype)
        self.backend = attention_backend
        self.scale = self.config.attention_scale  # 1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar)
        self.windows = self.config.windows  # per layer: its sliding window or None
        self.on_kv_written = None  # callable(KV store layer) after a forward wrote its K/V (P/D sends: kv/transfer.py)
        self.chunks = self.config.chunks  # per layer: its attention chunk or None
        self.slot_positions: SlotPositions | None = None  # set with the KV store when a layer has a window / chunk
        self.ring_wait_s = 0.0  # exposed ring / All2All time, accumulated for benchmarks
        self._tp_linears = [m for m in self.model.modules() if isinstance(m, RowParallelLinear)]
        self.store: KVStore | None = None
        self.tiers: RankTiers | None = None  # host pool and disk writer, when the engine has tiers
        self.decode = dict(decode or {"mode": "off"})
        self.static: StaticDecode | None = None  # made with the KV store when the decode mode is not "off"
        self.states: StateStore | None = None  # hybrid models: every state slot's replica (`kv/state_store.py`)
        self.kv_layer = {l: i for i, l in enumerate(self.config.attention_layers)}  # model layer -> KV store layer
        self.recurrent_exchange_s = 0.0  # hybrid models under CP: seconds in the recurrent layers' exchanges (timed
        #                                  only while `engine/recurrent.EXCHANGE_TIMER` is set)

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return KVStore.bytes_per_token(c.num_kv_layers, self.n_kv, self.widths, self.dtype.itemsize,
                                       self.kv_cache_dtype)

    def _kv_scales(self):
        """Static FP8 KV scales for this TP rank's KV heads: the checkpoint's, else calibrated on this model at load
        (`kv_fp8.calibrate_kv_scales`; every rank of a TP group calls this together); None when not static FP8."""
        if self.kv_cache_dtype != "fp8":
            return None
        c, tp = self.config, self.groups.config.tp
        kv_heads = head_ranges(c, tp, self.groups.tp_rank)[1]
        heads = slice(kv_heads.start, kv_heads.stop)
        scales = kv_fp8.checkpoint_kv_scales(self.model_path, c.num_hidden_layers, self.n_kv, heads,
                                             layers=c.attention_layers)  # (a hybrid's attention layers only)
        self.kv_scales_source = "checkpoint" if scales is not None else "calibrated"
        if scales is None:
            scales = kv_fp8.calibrate_kv_scales(self.model, c, self.ctx.device)
        elif c.values_in_keys:  # MLA: the checkpoint's k_scale scales the whole latent row (vLLM's convention)
            w = self.widths
            scales = kv_fp8.mla_scales(scales[0][:, 0], scales[0][:, 0], w.value, w.key - w.value)
        if self.ctx.rank == 0:
            k, v = scales
            log.info("FP8 KV cache: static scales per layer and KV head, %s (K %.3g-%.3g, V %.3g-%.3g)",
                     self.kv_scales_source, float(k.min()), float(k.max()), float(v.min()), float(v.max()))
        return scales

    def allocate_kv(self, capacity: int) -> None:
        c = self.config
        self.store = KVStore(c.num_kv_layers, capacity, self.n_kv, self.widths, self.dtype, self.ctx.device,
                             self.kv_cache_dtype, self._kv_scales())
        # positions of every rank's slots, mirrored from the batches, when some layer has a window or a chunk
        cp = self.groups.config.cp
        needs_positions = self.config.local_attention or self.config.dsa is not None  # (DSA: top-k ties by position)
        self.slot_positions = SlotPositions(cp, capacity) if needs_positions else None
        if self.config.hybrid:
            self.states = StateStore(self.state_layers(), self.dtype, self.ctx.device)
        if self.decode["mode"] != "off":
            if self.widths.key != self.widths.value and not self.widths.values_in_keys:
                raise ValueError("the static decode path (decode mode 'eager' / 'graph') takes one head size for "
                                 "keys and values, or values inside the keys (MLA); this model's differ: use decode "
                                 "mode 'off'")
            self.static = StaticDecode(self, self.decode["mode"], self.decode["max_rows"], self.decode.get("pieces"),
                                       self.decode.get("verify", "decode"), self.decode.get("verify_widths"))

    def state_layers(self) -> dict:
        """Recurrent layer -> (state shape, conv kernel, conv channels) of its mixer (hybrid models)."""
        layers = self.model.model.layers
        return {i: (layers[i].linear_attn.state_shape, layers[i].linear_attn.kernel, layers[i].linear_attn.conv_channels)
                for i in self.config.recurrent_layers}

    def profile_forward(self, tokens: int) -> None:
        """A forward of `tokens` new tokens on this rank alone, for its activation peak: every layer's tensors and
        logits as in `execute`, attention replaced by the buffers a ring step keeps (the fp32 accumulator, the
        received K/V block and its spare), not its O(tokens^2) compute. TP ranks all-reduce as usual."""
        dev = self.ctx.device
        ids = torch.zeros(tokens, dtype=torch.long, device=dev)  # [L]
        pos = torch.arange(tokens, device=dev)  # [L]

        def attn(layer: int, q, k, v, sinks=None, index=None):  # q [L, H, D], k/v [L, Hkv, D]
            acc_out, _ = new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)
            ring = k.new_empty((2, k.shape[0], k.shape[1], self.widths.stored))  # [2, L, Hkv, W]: block and spare
            del ring
            return acc_out.to(q.dtype)

        recurrent = None
        if self.config.hybrid:  # one sequence from a zero state (the recurrence's activations, no exchange)
            from cpinfer.model.recurrent.reference import ReferenceRecurrence

            recurrent = ReferenceRecurrence()
            recurrent.set_batch([0] * tokens)
        with torch.inference_mode():
            hidden = self.model(ids, pos, attn, recurrent)  # [L, hidden]
            rows = hidden[:min(tokens, _LOGIT_CHUNK)]
            logits = self.model.compute_logits(rows)  # [min(L, chunk), vocab] fp32, as prompt log-probs use
            torch.logsumexp(logits, dim=-1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def apply_cache_ops(self, ops) -> tuple:
        """Move K/V between tiers as the driver decided (before any new K/V are written); returns the tier events
        so far (writes done or failed, restore timings, failed disk reads)."""
        if ops:
            self.tiers.apply(ops)
            if self.slot_positions is not None:  # restored slots hold these positions now, on whichever rank
                for op in ops:
                    if isinstance(op, (FromHost, LoadEntry)):
                        self.slot_positions.pos[op.rank, op.slots] = op.positions
            for op in ops:
                if isinstance(op, (FromHost, LoadEntry)) and op.rank == self.groups.cp_rank:
                    self.store.note_written(op.slots)
        return self.tiers.events() if self.tiers is not None else ()

    def execute(self, batch: ForwardBatch) -> RankResult:
        t0 = time.perf_counter()
        rank, n = self.groups.cp_rank, self.groups.config.cp
        if self.states is not None:  # hybrid: roll back the last verify runs' rejected drafts, forget their states
            self.states.apply_picks(batch.state_picks)
        events = self.apply_cache_ops(batch.cache_ops)
        if self.slot_positions is not None:  # every rank mirrors every batch, idle or not
            self.slot_positions.record(batch)
        fell_back = False
        if self.static is not None:
            before = self.static.verify_fallbacks
            if self.static.handles(batch):
                return self._execute_static(batch, t0, events)
            fell_back = self.static.verify_fallbacks > before  # verify rows the static path could not take
        store = self.store
        plan = BatchAttention(batch, rank, n, self.groups.cp_group, self.backend, self.ctx.device, self.slot_positions)
        codecs = store.codecs
        recurrent = None
        if self.states is not None:  # hybrid: the recurrent layers' runner (every rank keeps every state replica)
            recurrent = RecurrentRunner(batch, rank, n, self.groups.cp_group, self.states,
                                        lambda b: plan.qoff[rank, b] + np.arange(plan.counts[rank, b]))
        if plan.idle:  # no token here and no ring in this forward: nothing to run
            if recurrent is not None and n > 1:  # ... but the recurrent layers' exchanges and replicas
                with torch.inference_mode():
                    recurrent.replicate(self.model)
                self.recurrent_exchange_s += recurrent.exchange_s
            return RankResult((), {}, time.perf_counter() - t0, 0.0, idle=True, tier_events=events,
                              verify_fallback=fell_back)
        store.note_written(plan.slots)
        expanded = batch.mla_form == "expanded" and store.widths.values_in_keys and self.config.dsa is None
        tables = plan.prepare(self.expanded_layout if expanded else self.layout, self.windows,  # every index, on
                              store.k.shape[1], self.chunks, store.widths.values_in_keys,  # the host
                              expanded=expanded)
        tables.upload()  # ... and moved to the device in one packed (pinned, non-blocking) copy, before layer 0
        dsa = self.config.dsa  # DeepSeek sparse attention: each query's top-k keys (`sparse_attention.py`)
        sparse = None if dsa is None else SparseAttention(plan, self.slot_positions, dsa.index_topk, self.ctx.device)
        t_plan = time.perf_counter()
        ids, pos, slots = tables[("input_ids",)], tables[("positions",)], tables[("slots",)]  # [L] each
        steps = []  # ring timings of every layer, read after the forward
        written = self.on_kv_written

        kv_of = self.kv_layer  # model layer -> its KV store layer (a hybrid's recurrent layers have none)

        def attn(layer: int, q, k, v, sinks=None, expand=None, index=None):  # q [L, H, D], k/v [L, Hkv, D] with
            # RoPE applied; sinks [H]; expand: MLA's expanded form, latent rows [N, 1, D] -> per-head (k [N, H, Dk],
            # v [N, H, Dv]); index: a DSA layer's `IndexerRows` (None on its "shared" layers)
            kv = kv_of[layer]
            if sparse is not None:  # DSA: rows [latent ; indexer key], the indexer's written on its "full" layers
                codec = None if codecs is None else codecs[kv][0]  # FP8: the latent's e4m3 bytes, read decoded
                store.k[kv][..., :store.widths.key].index_copy_(0, slots, k if codec is None else codec.encode(k))
                if index is not None:
                    store.write_index(kv, slots, index.k)
                if written is not None:
                    written(kv)
                return sparse.run(q, store.k[kv][..., :store.widths.key], store.index[kv], index, self.scale,
                                  v.shape[-1], decode_k=None if codec is None else
                                  (lambda rows: codec.decode(rows[:, None], store.dtype)[:, 0]),
                                  decode_index=store.read_index)
            if codecs is not None:  # FP8 rows, uint8 [L, Hkv, D (+ 4)] (MLA: v stays the view of k's first bytes)
                k, v = kv_fp8.encode_rows(codecs[kv], k, v, store.widths.values_in_keys)
            store.k[kv].index_copy_(0, slots, k)  # the cache operation: new K/V into the driver's slots
            if not store.widths.values_in_keys:  # (else v is k's first channels: written with them)
                store.v[kv].index_copy_(0, slots, v)
            if written is not None:  # a P/D prefill rank: this layer's rows go to the decode group now
                written(kv)
            return plan.run(q, k, v, store.k[kv], store.v[kv], self.scale, steps, self.windows[layer],
                            self.chunks[layer], sinks, store_used=store.used,
                            codecs=None if codecs is None else codecs[kv], expand=expand)

        attn.mla_form = "expanded" if expanded else "absorbed"  # what MLA layers give attention (`model/mla.py`)
        phases = {"plan": t_plan - t0}
        with torch.inference_mode():
            hidden = self.model(ids, pos, attn, recurrent)  # [L, hidden]
            if recurrent is not None:
                self.recurrent_exchange_s += recurrent.exchange_s
            if self.groups.tp_rank == 0:
                samples = self._sample(batch, plan, hidden, phases, t_plan)
                prompt_lp = self._prompt_logprobs(batch, plan, hidden)
            else:
                samples, prompt_lp = (), {}
        wait = sum(st["wait_s"] for st in timing.resolve(steps))  # CUDA event spans: one sync, after the forward
        for m in self._tp_linears:
            m.comm_s  # noqa: B018 - folds this forward's all-reduce spans (keeps the record bounded)
        self.ring_wait_s += wait
        phases.setdefault("model", time.perf_counter() - t_plan - phases.get("sample", 0.0))
        return RankResult(samples, prompt_lp, time.perf_counter() - t0, wait, tier_events=events, phases=phases,
                          verify_fallback=fell_back)

    def _execute_static(self, batch: ForwardBatch, t0: float, events: tuple) -> RankResult:
        """A decode forward (plain and verify rows) through the static-shape path (a CUDA graph replay once its
        bucket is captured)."""
        which, logits = self.static.execute(batch)  # my sequences, their logits [rows, vocab] on the device
        samples, phases = (), dict(self.static.last_phases)  # "plan" (host buffers), "model" (launch / replay)
        if self.groups.tp_rank == 0 and which:
            t1 = time.perf_counter()
            host_logits = logits.cpu()  # waits for the device
            t2 = time.perf_counter()
            samples = self._draw(batch, which, host_logits, self.draft_probs)
            phases["model"] = phases.get("model", 0.0) + t2 - t1
            phases["sample"] = time.perf_counter() - t2
        # a rank with no token and no ring to serve ran nothing: `which` is empty, `logits` None
        return RankResult(samples, {}, time.perf_counter() - t0, 0.0, idle=logits is None, tier_events=events,
                          phases=phases)

    def _sample(self, batch: ForwardBatch, plan: BatchAttention, hidden: torch.Tensor,
                phases: dict, t_model: float) -> tuple[SampleResult, ...]:
        """Sample every sequence whose last new token this rank holds (its logits never leave the rank); only
        those rows reach the lm_head. Notes the seconds from `t_model` to the logits on the host ("model") and of
        drawing ("sample") in `phases`."""
        rank = self.groups.cp_rank
        rows, which = [], []
        for b, s in enumerate(batch.seqs):
            if s.sample is not None and s.ranks[-1] == rank:
                last = int(plan.qoff[rank, b] + plan.counts[rank, b] - 1)  # its last token on this rank
                rows.extend(range(last - s.sampled_rows + 1, last + 1))  # a verify sequence: k+1 rows, one rank
                which.append(b)
        if not rows:
            return ()
        logits = self.model.compute_logits(hidden[torch.as_tensor(rows, device=hidden.device)]).cpu()
        t1 = time.perf_counter()
        phases["model"] = t1 - t_model
        out = self._draw(batch, which, logits, self.draft_probs)
        phases["sample"] = time.perf_counter() - t1
        return out

    @staticmethod
    def _draw(batch: ForwardBatch, which: list[int], logits: torch.Tensor,
              draft_probs: dict | None = None) -> tuple[SampleResult, ...]:
        """Sample sequence which[i] from its rows of logits ([rows, vocab] on the host, in order: one row per
        sequence, k+1 for a verify sequence, which keeps the target's distribution by spec/rejection.py with its
        proposer's q rows from draft_probs[draft_key] when it left some, else as deterministic drafts)."""
        starts = np.cumsum([0] + [batch.seqs[b].sampled_rows for b in which])  # which[i]: rows starts[i]:starts[i+1]
        plain = [i for i, b in enumerate(which) if batch.seqs[b].draft is None and plain_greedy(batch.seqs[b].sample)]
        greedy = {}  # several plain greedy sequences (a decode batch): their rows in one pass
        if len(plain) > 1:
            try:
                greedy = dict(zip(plain, greedy_rows(logits[torch.as_tensor(starts[plain])])))
            except Exception:  # noqa: BLE001 - then each row alone below, where a failure is its request's
                pass
        out = []
        for i, b in enumerate(which):
            s = batch.seqs[b]
            rows = logits[starts[i]:starts[i + 1]]
            try:
                if i in greedy:
                    out.append(SampleResult(b, *greedy[i], ()))
                    continue
                if s.draft is None:
                    out.append(SampleResult(b, *sample(rows[0], s.sample)))
                    continue
                q = draft_probs.pop(s.draft_key, None) if draft_probs is not None else None  # [k, vocab] or None
                if s.draft_q is not None:
                    q = torch.as_tensor(s.draft_q)
                specs = row_specs(s.sample, s.draft, s.draft_allowed, s.draft_suppress)
                *extra, (token, lp, top) = verify(rows, s.draft, specs, q)
                out.append(SampleResult(b, token, lp, top, extra=tuple(extra)))
            except Exception as exc:  # noqa: BLE001 - one request's failure is that request's, not the forward's
                out.append(SampleResult(b, -1, 0.0, (), f"{type(exc).__name__}: {exc}"))
        return tuple(out)

    def _prompt_logprobs(self, batch: ForwardBatch, plan: BatchAttention, hidden: torch.Tensor) -> dict:
        """log p(next token) for each new token of a prompt-log-probs sequence held here, by offset in the chunk
        (and the top-k of each position's distribution for a sequence that asks).

        Logits and their log-sum-exp stay on the device, chunk by chunk; only the chosen values (and top-k) cross
        to the host, in one copy per forward (two more with top-k)."""
        rank, dev = self.groups.cp_rank, hidden.device
        wanted, parts, tops = [], [], []
        for b, s in enumerate(batch.seqs):
            if not s.prompt_logprobs or not plan.counts[rank, b]:
                continue
            offsets = plan.idx[rank][b]
            targets_all = np.append(s.token_ids[1:], s.next_token)
            keep = targets_all[offsets] >= 0
            offsets = offsets[keep]
            rows = torch.from_numpy(plan.qoff[rank, b] + np.nonzero(keep)[0]).to(dev)  # [M] rows of `hidden`
            targets = torch.from_numpy(targets_all[offsets]).to(dev)  # [M] the next token of each
            for a in range(0, len(offsets), _LOGIT_CHUNK):
                logits = self.model.compute_logits(hidden[rows[a:a + _LOGIT_CHUNK]])  # [m, vocab] fp32
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [m, 1]
                chosen = logits.gather(1, targets[a:a + _LOGIT_CHUNK, None])  # [m, 1]
                parts.append((chosen - lse).squeeze(1))
                if s.prompt_top:
                    vals, ids = torch.topk(logits, min(s.prompt_top, logits.shape[1]), dim=-1)  # [m, k]
                    tops.append((ids, vals - lse))
            wanted.append((b, offsets, s.prompt_top))
        if not wanted:
            return {}
        values = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, dtype=np.float32)  # the one host copy
        result, at, t = {}, 0, 0
        for b, offsets, k in wanted:
            result[b] = (offsets, values[at:at + len(offsets)])
            if k and len(offsets):
                n_chunks = -(-len(offsets) // _LOGIT_CHUNK)
                chunk = tops[t:t + n_chunks]
                t += n_chunks
                result[b] += (torch.cat([i for i, _ in chunk]).cpu().numpy(),
                              torch.cat([v for _, v in chunk]).cpu().numpy())
            at += len(offsets)
        return result


# ---------------------------------------------------------------- functions the driver runs on every rank

def init_runner(ctx, model_path: str, dtype: str, capacity: int | None, cp: int = 1, tp: int = 1,
                attention_backend: str | None = None, sizing: dict | None = None, decode: dict | None = None,
                kv_cache_dtype: str = "auto", load_format: str = "auto") -> dict:
    """Load this rank's model. With a capacity, allocate its KV store now; with None (CUDA), measure instead:
    `sizing` = {"tokens", "utilization", "ranks_per_device", "block"} (and a draft model's "extra_bytes_per_token",
    "reserve_bytes", loaded later) → the KV tokens this rank could hold
    (`kv_capacity`), and its memory figures; the driver then calls `allocate_kv` with the smallest. `decode`: the
    static decode path's mode and bucket bound (`ModelRunner`)."""
    probe = None
    if capacity is None:
        probe = MemoryProbe(ctx.device, shared=sizing["ranks_per_device"] > 1)
        probe.start()
    old = ctx.state.get("runner")
    ctx.state.pop("draft", None)  # a draft model belongs to the runner it was loaded beside
    if old is not None and old.tiers is not None:  # a pool reused by another engine
        old.tiers.close()
    t0 = time.perf_counter()
    runner = ModelRunner(ctx, model_path, getattr(torch, dtype), ParallelConfig(cp, tp), attention_backend, decode,
                         kv_cache_dtype, load_format)
    t1 = time.perf_counter()
    # "auto" on this rank's device: the probes, then (on a GPU) the fastest on this model's heads, timed once
    tokens = None if sizing is None else sizing["tokens"]
    backend = runner.backend = resolve_name(attention_backend, ctx.device, layout=runner.layout, tokens=tokens)
    ctx.state["runner"] = runner
    choice = autoselect.chosen(ctx.device, runner.layout, tokens)
    t2 = time.perf_counter()
    info = {"pid": os.getpid(), "attention_backend": backend, "load_s": t1 - t0, "warmup_s": t2 - t1,
            "attention_timings_ms": dict(choice.timings_ms) if choice is not None and choice.name == backend else {}}
    if capacity is not None:
        runner.allocate_kv(capacity)
        info["kv_s"] = time.perf_counter() - t2
        return info
    info.update(measure_kv(runner, probe, sizing))
    info["kv_s"] = time.perf_counter() - t2
    return info


def measure_kv(runner: ModelRunner, probe: MemoryProbe, sizing: dict) -> dict:
    """After the weights loaded under `probe`: a profiling forward of `sizing["tokens"]` on this rank, then the KV
    tokens this rank could hold (`kv_tokens_from_memory`, a draft model's bytes counted) and its memory figures."""
    runner.profile_forward(sizing["tokens"])
    fig = probe.figures()
    return {"memory": dataclasses.asdict(fig), "kv_bytes_per_token": runner.kv_bytes_per_token,
            "kv_capacity": kv_tokens_from_memory(fig, sizing["utilization"],
                                                 runner.kv_bytes_per_token + sizing.get("extra_bytes_per_token", 0),
                                                 sizing["block"], sizing["ranks_per_device"],
                                                 sizing.get("reserve_bytes", 0))}


def allocate_kv(ctx, capacity: int) -> None:
    ctx.state["runner"].allocate_kv(capacity)


def kv_token_bytes(ctx) -> int:
    """One token's K/V bytes on this rank (its TP share of the KV heads, every layer)."""
    return ctx.state["runner"].kv_bytes_per_token


def init_tiers(ctx, host_slots: int, disk_dir: str | None, writable: bool, layout, cp: int,
               tp_shared: bool = False, host_state_slots: int = 0) -> None:
    """Give this rank a host pool of host_slots tokens and, with disk_dir, disk reads (and a writer when writable),
    replacing earlier ones. `tp_shared` (MLA under TP: every TP rank caches the same latent): TP rank 0 alone keeps
    the host copy. Hybrid models: host_state_slots recurrent-state snapshots in the host tier."""
    runner = ctx.state["runner"]
    if runner.tiers is not None:
        runner.tiers.close()
    g = runner.groups
    shared = SharedRows(g.tp_group, g.config.rank_of(g.cp_rank, 0)) if tp_shared and g.config.tp > 1 else None
    runner.tiers = RankTiers(runner.store, g.cp_rank, g.tp_rank, host_slots, disk_dir, writable, layout, cp,
                             ctx.device, shared=shared, states=runner.states, host_state_slots=host_state_slots,
                             cp_group=g.cp_group)


def apply_cache_ops(ctx, ops, state_picks=()) -> tuple:
    """Cache operations outside a forward (disk restores before it, writes when idle); returns tier events. A hybrid's
    pending verify rollbacks (`state_picks`) come first, so that no state is saved or restored before it."""
    runner = ctx.state["runner"]
    if runner.states is not None and state_picks:
        runner.states.apply_picks(state_picks)
    return runner.apply_cache_ops(ops)


def flush_tiers(ctx) -> tuple:
    """Wait until every queued disk write is done; returns the tier events (graceful shutdown)."""
    runner = ctx.state["runner"]
    if runner.tiers is None:
        return ()
    runner.tiers.flush()
    return runner.tiers.events()


def execute_batch(ctx, batch: ForwardBatch | bytes) -> RankResult:
    """Run one forward (a ForwardBatch, or its pickle)."""
    if isinstance(batch, bytes):
        batch = pickle.loads(batch)
    draft = ctx.state.get("draft")  # a draft model (`spec/draft_runner.py`) mirrors every forward of the target
    if draft is not None:
        draft.mirror(batch)
    return ctx.state["runner"].execute(batch)


def active_cp_ranks(batch: ForwardBatch, n: int) -> np.ndarray:
    """[n] bool: the CP ranks that work in this forward — every one when a sequence spreads (the ring needs them
    all), else those holding a local sequence's tokens — and those with cache operations to apply."""
    active = np.zeros(n, dtype=bool)
    for op in batch.cache_ops:
        active[op.rank] = True
    for s in batch.seqs:
        if s.spread:
            active[:] = True
            break
        active[s.ranks[0]] = True
    return active


def ring_wait(ctx) -> float:
    return ctx.state["runner"].ring_wait_s


def recurrent_exchange(ctx) -> float:
    """Seconds this rank spent in the recurrent layers' exchanges so far (hybrid models under CP)."""
    return ctx.state["runner"].recurrent_exchange_s
