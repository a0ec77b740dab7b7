"""Rank-side execution of one forward pass (SPMD: every rank runs the same `execute` on the same batch).

A `ForwardBatch` says which sequences take part, their new tokens and cached lengths, and the strategy. From it
every process derives the same placement (`place_batch`) — which rank holds which new token and in which KV
slot — so the plan is built without communication; then each rank runs the model on its token shard with
`cp_attention` injected, and returns the logits it owns.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from cpinfer.cp import plan_from_metadata
from cpinfer.cp.sharding import ShardPlan, shard_decode, shard_prefill
from cpinfer.kvcache import ClusterLayout, KVStore
from cpinfer.distributed import ParallelConfig, build_groups
from cpinfer.model import ModelConfig, load_model
from cpinfer.tensor_parallel import load_tp_model

_LOGIT_CHUNK = 1024  # rows per chunk when computing prompt log-probabilities


@dataclasses.dataclass(frozen=True)
class SeqWork:
    seq_id: int
    token_ids: tuple[int, ...]  # new tokens, at positions num_cached ...
    num_cached: int
    prompt_logprobs: bool = False
    decode_rank: int = -1  # decode only: the rank that holds this token


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    kind: str  # "prefill" | "decode"
    seqs: tuple[SeqWork, ...]
    strategy: str
    free: tuple[int, ...] = ()  # sequences evicted before this forward
    truncate: tuple[tuple[int, int], ...] = ()  # (seq, keep positions below) before this forward


@dataclasses.dataclass
class Placement:
    shard: ShardPlan
    slots: list[np.ndarray]  # per rank: KV slot of each valid row of its shard
    tokens: np.ndarray  # flat new tokens (sequence order)


def place_batch(layout: ClusterLayout, batch: ForwardBatch) -> Placement:
    """Apply the batch's cache operations and allocate slots for its new tokens, on every rank's layout."""
    for s in batch.free:
        layout.free(s)
    for s, p in batch.truncate:
        layout.truncate(s, p)
    n = len(layout.ranks)
    ids = [w.seq_id for w in batch.seqs]
    if batch.kind == "decode":
        shard = shard_decode([w.num_cached for w in batch.seqs], [w.decode_rank for w in batch.seqs], n, ids)
    else:
        shard = shard_prefill([len(w.token_ids) for w in batch.seqs], n, [w.num_cached for w in batch.seqs], ids)
    slots = []
    for r, sh in enumerate(shard.shards):
        mine = np.zeros(int(sh.valid.sum()), dtype=np.int64)
        valid_rows = np.nonzero(sh.valid)[0]
        for sid in ids:
            rows = np.nonzero(sh.seq[valid_rows] == sid)[0]
            if len(rows):
                mine[rows] = layout.ranks[r].append(sid, sh.pos[valid_rows[rows]])
        slots.append(mine)
    tokens = np.concatenate([np.asarray(w.token_ids, dtype=np.int64) for w in batch.seqs])
    return Placement(shard, slots, tokens)


class Worker:
    """One rank's model replica, KV shard and view of every rank's cache layout."""

    def __init__(self, ctx, model_path: str, dtype: torch.dtype, capacity: int, parallel: ParallelConfig):
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
        self.layout = ClusterLayout(parallel.cp, capacity)
        self.ring_wait_s = 0.0  # exposed ring / All2All time, accumulated for benchmarks
        self.store = KVStore(c.num_hidden_layers, self.layout.ranks[0].capacity, n_kv, c.head_dim, dtype, ctx.device)

    def execute(self, batch: ForwardBatch) -> dict:
        t0 = time.perf_counter()
        rank, n = self.groups.cp_rank, self.groups.config.cp
        place = place_batch(self.layout, batch)
        shards = place.shard.shards
        me = shards[rank]
        kv_meta = []
        for lay in self.layout.ranks:
            hw = lay.high_water()
            kv_meta.append((lay.seq[:hw], lay.pos[:hw]))
        plan = plan_from_metadata([(sh.seq, sh.pos) for sh in shards], kv_meta, group=self.groups.cp_group,
                                  rank=rank, world=n, strategy=batch.strategy)
        hw = len(kv_meta[rank][0])
        dev = self.ctx.device
        valid = torch.from_numpy(me.valid).to(dev)
        slots = torch.from_numpy(place.slots[rank]).to(dev)
        ids = torch.from_numpy(np.where(me.valid, place.tokens[np.maximum(me.index, 0)], 0)).to(dev)
        pos = torch.from_numpy(me.pos).to(dev)
        store = self.store

        def attn(layer: int, q, k, v):  # q [L, H, D], k/v [L, Hkv, D] with RoPE applied
            store.k[layer].index_copy_(0, slots, k[valid])
            store.v[layer].index_copy_(0, slots, v[valid])
            steps: list[dict] = []
            out = plan.run(q, store.k[layer, :hw], store.v[layer, :hw], timings=steps)
            self.ring_wait_s += sum(st["wait_s"] for st in steps)  # exposed CP communication
            return out

        with torch.inference_mode():
            hidden = self.model(ids, pos, attn)  # [L, hidden]
            # every TP rank of a node holds the same hidden states: one of them reports
            result = self._outputs(batch, place, hidden) if self.groups.tp_rank == 0 else {"last": {}, "prompt_lp": {}}
        result["forward_s"] = time.perf_counter() - t0
        return result

    def _outputs(self, batch: ForwardBatch, place: Placement, hidden: torch.Tensor) -> dict:
        """Logits of each sequence's last new token held here; prompt log-probs of rows held here."""
        me = place.shard.shards[self.groups.cp_rank]
        starts = np.cumsum([0] + [len(w.token_ids) for w in batch.seqs])
        last_flat = {int(starts[i + 1] - 1): w.seq_id for i, w in enumerate(batch.seqs)}
        rows = np.nonzero(np.isin(me.index, list(last_flat)))[0]
        last = {}
        if len(rows):
            logits = self.model.compute_logits(hidden[rows])  # [len(rows), vocab] fp32
            last = {last_flat[int(me.index[r])]: logits[i].cpu() for i, r in enumerate(rows)}
        prompt_lp = {}
        for i, w in enumerate(batch.seqs):
            if not w.prompt_logprobs:
                continue
            sel = np.nonzero((me.seq == w.seq_id) & me.valid & (me.index < starts[i + 1] - 1))[0]
            targets = torch.from_numpy(place.tokens[me.index[sel] + 1])
            values = torch.empty(len(sel))
            for a in range(0, len(sel), _LOGIT_CHUNK):
                lp = torch.log_softmax(self.model.compute_logits(hidden[sel[a:a + _LOGIT_CHUNK]]), dim=-1)
                values[a:a + _LOGIT_CHUNK] = lp.gather(1, targets[a:a + _LOGIT_CHUNK, None]).squeeze(1).cpu()
            prompt_lp[w.seq_id] = (me.index[sel] - starts[i], values)  # offset within the new tokens → log p(next)
        return {"last": last, "prompt_lp": prompt_lp}


# ---------------------------------------------------------------- functions the driver runs on every rank

def init_worker(ctx, model_path: str, dtype: str, capacity: int, cp: int = 1, tp: int = 1) -> dict:
    w = Worker(ctx, model_path, getattr(torch, dtype), capacity, ParallelConfig(cp, tp))
    ctx.state["worker"] = w
    return {"capacity": w.layout.ranks[0].capacity}


def execute_batch(ctx, batch: ForwardBatch) -> dict:
    return ctx.state["worker"].execute(batch)
