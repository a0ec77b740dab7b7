"""The rank side (SPMD): one model replica and this rank's KV shard; runs each `ForwardBatch` as told.

`execute` reads as four steps: plan attention for the batch → run the model on this rank's new tokens (writing
their K/V into the given slots, then CP attention) → sample where the logits are → return token ids and the
log-probabilities asked for. A rank with no token and no ring to serve skips the model. Only TP rank 0 of each CP
rank reports (every TP rank holds the same hidden states).
"""
from __future__ import annotations

import os
import pickle
import time

import numpy as np
import torch

from cpinfer.distributed import ParallelConfig, build_groups
from cpinfer.engine.attention import BatchAttention
from cpinfer.engine.batch import ForwardBatch, RankResult, SampleResult
from cpinfer.engine.sampling import sample
from cpinfer.model import ModelConfig, load_model
from cpinfer.tensor_parallel import load_tp_model

_LOGIT_CHUNK = 1024  # rows per chunk when computing prompt log-probabilities


class KVStore:
    """This rank's K/V tensors: k, v [layers, capacity, Hkv, D], indexed by the slots the driver assigns."""

    def __init__(self, num_layers: int, capacity: int, n_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, capacity, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
        return 2 * num_layers * n_kv_heads * head_dim * elem_bytes


class ModelRunner:
    def __init__(self, ctx, model_path: str, dtype: torch.dtype, capacity: int, parallel: ParallelConfig,
                 attention_backend: str | None = None):
        self.ctx = ctx
        self.groups = build_groups(parallel, ctx.rank, ctx.group)
        if parallel.tp == 1:
            self.config, self.model = load_model(model_path, dtype=dtype, device=ctx.device)
        else:
            self.config = ModelConfig.from_pretrained(model_path)
            self.model = load_tp_model(model_path, self.config, parallel.tp, self.groups.tp_rank,
                                       self.groups.tp_group, dtype=dtype, device=ctx.device)
        c = self.config
        n_kv = self.model.model.layers[0].self_attn.num_kv_heads  # this TP rank's KV heads
        self.backend = attention_backend
        self.scale = c.head_dim ** -0.5
        self.ring_wait_s = 0.0  # exposed ring / All2All time, accumulated for benchmarks
        self.store = KVStore(c.num_hidden_layers, capacity, n_kv, c.head_dim, dtype, ctx.device)

    def execute(self, batch: ForwardBatch) -> RankResult:
        t0 = time.perf_counter()
        rank, n = self.groups.cp_rank, self.groups.config.cp
        plan = BatchAttention(batch, rank, n, self.groups.cp_group, self.backend, self.ctx.device)
        if plan.idle:  # no token here and no ring in this forward: nothing to run
            return RankResult((), {}, time.perf_counter() - t0, 0.0, idle=True)
        dev = self.ctx.device
        ids = torch.from_numpy(plan.input_ids).to(dev)
        pos = torch.from_numpy(plan.positions).to(dev)
        slots = torch.from_numpy(plan.slots).to(dev)
        store, wait = self.store, [0.0]

        def attn(layer: int, q, k, v):  # q [L, H, D], k/v [L, Hkv, D] with RoPE applied
            store.k[layer].index_copy_(0, slots, k)  # the cache operation: new K/V into the driver's slots
            store.v[layer].index_copy_(0, slots, v)
            steps: list[dict] = []
            out = plan.run(q, k, v, store.k[layer], store.v[layer], self.scale, steps)
            wait[0] += sum(st["wait_s"] for st in steps)
            return out

        with torch.inference_mode():
            hidden = self.model(ids, pos, attn)  # [L, hidden]
            if self.groups.tp_rank == 0:
                samples, prompt_lp = self._sample(batch, plan, hidden), self._prompt_logprobs(batch, plan, hidden)
            else:
                samples, prompt_lp = (), {}
        self.ring_wait_s += wait[0]
        return RankResult(samples, prompt_lp, time.perf_counter() - t0, wait[0])

    def _sample(self, batch: ForwardBatch, plan: BatchAttention, hidden: torch.Tensor) -> tuple[SampleResult, ...]:
        """Sample every sequence whose last new token this rank holds (its logits never leave the rank)."""
        rank = self.groups.cp_rank
        rows, which = [], []
        for b, s in enumerate(batch.seqs):
            if s.sample is not None and s.ranks[-1] == rank:
                rows.append(int(plan.qoff[rank, b] + plan.counts[rank, b] - 1))  # its last token on this rank
                which.append(b)
        if not rows:
            return ()
        logits = self.model.compute_logits(hidden[torch.as_tensor(rows, device=hidden.device)]).cpu()
        out = []
        for b, row_logits in zip(which, logits):
            token, lp, top = sample(row_logits, batch.seqs[b].sample)
            out.append(SampleResult(b, token, lp, top))
        return tuple(out)

    def _prompt_logprobs(self, batch: ForwardBatch, plan: BatchAttention, hidden: torch.Tensor) -> dict:
        """log p(next token) for each new token of a prompt-log-probs sequence held here, by offset in the chunk."""
        rank, result = self.groups.cp_rank, {}
        for b, s in enumerate(batch.seqs):
            if not s.prompt_logprobs or not plan.counts[rank, b]:
                continue
            offsets = plan.idx[rank][b]
            targets_all = np.append(s.token_ids[1:], s.next_token)
            keep = targets_all[offsets] >= 0
            offsets = offsets[keep]
            rows = torch.from_numpy(plan.qoff[rank, b] + np.nonzero(keep)[0])
            targets = torch.from_numpy(targets_all[offsets])
            values = torch.empty(len(offsets))
            for a in range(0, len(offsets), _LOGIT_CHUNK):
                lp = torch.log_softmax(self.model.compute_logits(hidden[rows[a:a + _LOGIT_CHUNK]]), dim=-1).cpu()
                values[a:a + _LOGIT_CHUNK] = lp.gather(1, targets[a:a + _LOGIT_CHUNK, None]).squeeze(1)
            result[b] = (offsets, values.numpy())
        return result


# ---------------------------------------------------------------- functions the driver runs on every rank

def init_runner(ctx, model_path: str, dtype: str, capacity: int, cp: int = 1, tp: int = 1,
                attention_backend: str | None = None) -> dict:
    runner = ModelRunner(ctx, model_path, getattr(torch, dtype), capacity, ParallelConfig(cp, tp), attention_backend)
    ctx.state["runner"] = runner
    return {"pid": os.getpid()}


def execute_batch(ctx, batch: ForwardBatch | bytes | None) -> RankResult:
    """Run one forward (a ForwardBatch, or its pickle); None: this rank has nothing to do in it."""
    if batch is None:
        return RankResult((), {}, 0.0, 0.0, idle=True)
    if isinstance(batch, bytes):
        batch = pickle.loads(batch)
    return ctx.state["runner"].execute(batch)


def active_cp_ranks(batch: ForwardBatch, n: int) -> np.ndarray:
    """[n] bool: the CP ranks that work in this forward — every one when a sequence spreads (the ring needs them
    all), else those holding a local sequence's tokens."""
    active = np.zeros(n, dtype=bool)
    for s in batch.seqs:
        if s.spread:
            active[:] = True
            break
        active[s.ranks[0]] = True
    return active


def ring_wait(ctx) -> float:
    return ctx.state["runner"].ring_wait_s
