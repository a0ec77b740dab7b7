"""`LLM`: the user-facing engine (shaped like vLLM's). The driver schedules, chooses strategies and samples; the
N context-parallel ranks run each forward SPMD (`engine.worker`). Finished sequences stay in the sharded KV
cache, and a new prompt that starts with a cached sequence's tokens reuses them (partial prefill, paper §3.3).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from cpinfer.cp.sharding import shard_prefill
from cpinfer.engine import worker as W
from cpinfer.engine.sampling import SamplingParams, sample
from cpinfer.engine.strategy import choose_for_batch
from cpinfer.kvcache import BLOCK, ClusterLayout, KVStore
from cpinfer.distributed import ParallelConfig
from cpinfer.launch import JoinedWorld, RemoteError, WorkerPool, joined_world_requested
from cpinfer.model.config import ModelConfig
from cpinfer.model.loader import checkpoint_files
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.utils import ceil_div, get_logger

log = get_logger()


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    num_cached_tokens: int
    finish_reason: str
    metrics: dict
    seq_id: int = -1  # the KV-cache sequence that holds this conversation (see LLM.kv_tokens_per_rank)


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    seq_id: int = -1
    num_cached: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_lp: list | None = None
    finish: str | None = None
    generator: torch.Generator | None = None
    metrics: dict = dataclasses.field(default_factory=lambda: {"steps": [], "ttit_s": []})
    t_last: float = 0.0
    decode_rank: int = 0


class LLM:
    """Serve a Llama-3 checkpoint over `context_parallel_size` ranks.

    model: directory with config.json + *.safetensors (+ tokenizer files to accept strings).
    max_kv_tokens_per_rank: KV capacity of each rank in tokens (default: from kv_memory_fraction of RAM).
    strategy: "auto" (full prefill → pass-KV, partial prefill → Alg. 5, decode → pass-Q) or "pass-kv"/"pass-q".
    """

    def __init__(self, model: str, context_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 device: str = "cpu", dtype: str = "float32", max_kv_tokens_per_rank: int | None = None,
                 kv_memory_fraction: float = 0.25, strategy: str = "auto", hardware_profile: str | None = None,
                 threads_per_rank: int | None = None, timeout_s: float = 600.0):
        self.config = ModelConfig.from_pretrained(model)  # validates the directory before starting ranks
        checkpoint_files(Path(model))  # raises ValueError when no weights are there
        self._check_args(context_parallel_size, tensor_parallel_size, device, dtype, strategy)
        self.n = context_parallel_size
        self.parallel = ParallelConfig(context_parallel_size, tensor_parallel_size)
        self.parallel.check_model(self.config.num_attention_heads, self.config.num_key_value_heads)
        if self.config.intermediate_size % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must divide intermediate_size "
                             f"({self.config.intermediate_size})")
        self.strategy = strategy
        # a catalog name or a `cpinfer calibrate` JSON; loaded now so a bad path fails before any rank starts
        self.hardware = load_hardware_profile(hardware_profile or ("cpu-gloo" if device == "cpu" else "h100-gtt"))
        self.elem_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        capacity = max_kv_tokens_per_rank or self._default_capacity(kv_memory_fraction)
        if capacity < BLOCK:
            raise ValueError(f"max_kv_tokens_per_rank must be >= {BLOCK}, got {capacity}")
        self.tokenizer = _load_tokenizer(model)
        world = self.parallel.world_size
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world)
        backend = "gloo" if device == "cpu" else "nccl"
        if joined_world_requested():  # under torchrun: join it; only rank 0 comes back from here
            self._pool = JoinedWorld(backend, threads_per_rank, timeout_s)
            self.parallel.check_world(self._pool.world_size)
        else:
            self._pool = WorkerPool(world, backend=backend, threads_per_rank=threads, timeout_s=timeout_s)
        try:
            if isinstance(self._pool, JoinedWorld) and self._pool.rank != 0:
                self._pool.serve_forever()  # never returns: the process exits when rank 0 shuts down
            self._pool.run(W.init_worker, model, dtype, capacity, self.n, tensor_parallel_size)
        except RemoteError as exc:  # e.g. a missing or mis-shaped tensor: the loader's message, as ValueError
            self._pool.close(force=True)
            if exc.exception_type == "ValueError":
                raise ValueError(exc.errors[min(exc.errors)][1]) from None
            raise
        except BaseException:
            self._pool.close(force=True)
            raise
        self.layout = ClusterLayout(self.n, capacity)  # the driver's mirror of every rank's cache
        self._cached: dict[int, list[int]] = {}  # seq id → tokens whose K/V are stored
        self._last_used: dict[int, float] = {}
        self._ids = itertools.count()
        self._pending_free: list[int] = []  # cache operations the ranks apply before the next forward
        self._truncations: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ set-up helpers
    @staticmethod
    def _check_args(cp, tp, device, dtype, strategy):
        if not isinstance(cp, int) or cp < 1:
            raise ValueError(f"context_parallel_size must be a positive integer, got {cp!r}")
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")
        if strategy not in ("auto", "pass-kv", "pass-q"):
            raise ValueError(f"strategy must be 'auto', 'pass-kv' or 'pass-q', got {strategy!r}")

    def _default_capacity(self, fraction: float) -> int:
        c = self.config
        per_token = KVStore.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.elem_bytes)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        tokens = int(total * fraction / self.n / per_token)
        return max(BLOCK, min(tokens, 4 * c.max_position_embeddings) // BLOCK * BLOCK)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and getattr(self, "_pool", None) is not None:
            self._pool.close(force=True)
            self._pool = None
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ public API
    def kv_tokens_per_rank(self, seq_id: int) -> list[int]:
        """How many of a cached sequence's K/V tokens each CP rank stores (RequestOutput.seq_id)."""
        return self.layout.tokens_per_rank(seq_id)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns one output per prompt, in order."""
        if self._pool is None:
            raise RuntimeError("LLM has been shut down")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        reqs = [self._new_request(p, sp) for p, sp in zip(prompts, params)]  # validates all before any compute
        t_start = time.perf_counter()
        waiting, running = list(reqs), []
        while waiting or running:
            admitted = self._admit(waiting, running)
            if admitted:
                self._prefill(admitted, t_start, use_tqdm)
                running += admitted  # those already finished (max_tokens=1, EOS) are released below
            elif running:
                self._decode(running)
            else:
                raise RuntimeError("scheduler stalled: a request fits no cache state (this is a bug)")
            for r in [r for r in running if r.finish is not None]:
                running.remove(r)
                self._release(r)
        return [self._output(r) for r in reqs]

    # ------------------------------------------------------------------ requests and cache
    def _new_request(self, prompt, params: SamplingParams) -> _Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model directory has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        total = len(prompt) + params.max_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                             f"model's max_position_embeddings ({self.config.max_position_embeddings})")
        need = ceil_div(len(prompt), 2 * self.n) * 2 + ceil_div(params.max_tokens, self.n) + 1
        cap = self.layout.ranks[0].capacity
        if ceil_div(need, BLOCK) + 1 > self.layout.ranks[0].num_blocks:
            raise ValueError(f"request needs about {need} KV tokens per rank (prompt {len(prompt)}, max_tokens "
                             f"{params.max_tokens}, CP={self.n}) but each rank holds {cap}; raise "
                             "max_kv_tokens_per_rank or context_parallel_size, or shorten the request")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return _Request(prompt, params, generator=gen)

    def _match_prefix(self, prompt: list[int], busy: set[int]) -> tuple[int, int]:
        """(cached seq id, reusable length) of the longest cached prefix of prompt, or (-1, 0)."""
        best, best_len = -1, 0
        p = np.asarray(prompt)
        for sid, toks in self._cached.items():
            if sid in busy or not toks:
                continue
            m = min(len(toks), len(p) - 1)  # at least one new token must be computed
            neq = np.nonzero(np.asarray(toks[:m]) != p[:m])[0]
            common = int(neq[0]) if len(neq) else m
            if common > best_len:
                best, best_len = sid, common
        return best, best_len

    def _admit(self, waiting: list[_Request], running: list[_Request]) -> list[_Request]:
        """Move requests that fit into the cache (evicting LRU finished sequences) from waiting to a prefill."""
        admitted = []
        busy = {r.seq_id for r in running}
        while waiting:
            r = waiting[0]
            sid, m = (-1, 0) if r.params.prompt_logprobs else self._match_prefix(r.prompt, busy)
            plan_need = self._blocks_needed(running + admitted, r, sid, m)
            if not self._make_room(plan_need, busy | {sid}):
                break
            waiting.pop(0)
            if sid >= 0:
                self.layout.truncate(sid, m)
                r.seq_id, r.num_cached = sid, m
                self._truncations.append((sid, m))
            else:
                r.seq_id = next(self._ids)
            self._cached.pop(r.seq_id, None)
            busy.add(r.seq_id)
            admitted.append(r)
        return admitted

    def _blocks_needed(self, active: list[_Request], r: _Request, sid: int, m: int) -> list[int]:
        """Blocks each rank needs for r's prefill and the remaining decode of every active request."""
        need = [0] * self.n
        new = shard_prefill([len(r.prompt) - m], self.n, [m])
        for rank, sh in enumerate(new.shards):
            lay = self.layout.ranks[rank]
            kept = int(np.sum(lay.pos[lay.slots_of(sid)] < m)) if sid >= 0 else 0
            total = kept + int(sh.valid.sum()) + ceil_div(r.params.max_tokens, self.n) + 1
            need[rank] += ceil_div(total, BLOCK) - (ceil_div(lay.tokens_of(sid), BLOCK) if sid >= 0 else 0)
            for a in active:
                left = a.params.max_tokens - len(a.out) + 1
                need[rank] += lay.blocks_needed(a.seq_id, ceil_div(left, self.n)) if a.seq_id >= 0 else 0
        return need

    def _make_room(self, need: list[int], keep: set[int]) -> bool:
        """Evict least-recently-used finished sequences until every rank has `need` free blocks."""
        def short():
            return any(lay.free_blocks() < nd for lay, nd in zip(self.layout.ranks, need))
        while short():
            victims = sorted((t, s) for s, t in self._last_used.items() if s not in keep)
            if not victims:
                return False
            _, sid = victims[0]
            self.layout.free(sid)
            self._pending_free.append(sid)
            self._cached.pop(sid, None)
            self._last_used.pop(sid, None)
        return True

    def _release(self, r: _Request) -> None:
        self._cached[r.seq_id] = r.prompt + r.out[:-1]  # the last sampled token was never fed
        self._last_used[r.seq_id] = time.monotonic()

    # ------------------------------------------------------------------ forwards
    def _run(self, kind: str, works: list[W.SeqWork], strategy_choice) -> list[dict]:
        batch = W.ForwardBatch(kind, tuple(works), strategy_choice.strategy, tuple(self._pending_free),
                               tuple(self._truncations))
        self._pending_free, self._truncations = [], []
        # the driver's mirror applied the evictions and truncations when it admitted the requests; it replays only
        # the slot allocation, so it stays in step with the ranks
        W.place_batch(self.layout, dataclasses.replace(batch, free=(), truncate=()))
        return self._pool.run(W.execute_batch, batch)

    def _prefill(self, reqs: list[_Request], t_start: float, use_tqdm: bool) -> None:
        works = [W.SeqWork(r.seq_id, tuple(r.prompt[r.num_cached:]), r.num_cached, r.params.prompt_logprobs)
                 for r in reqs]
        cached_before = [self.layout.tokens_per_rank(r.seq_id) for r in reqs]
        choice = choose_for_batch(self, works, "prefill")
        if use_tqdm:
            log.info("prefill: %d sequences, %d new tokens, strategy %s", len(works),
                     sum(len(w.token_ids) for w in works), choice.strategy)
        results = self._run("prefill", works, choice)
        now = time.perf_counter()
        for r, w, before in zip(reqs, works, cached_before):
            after = self.layout.tokens_per_rank(r.seq_id)
            r.metrics.update(ttft_s=now - t_start, num_new_tokens=len(w.token_ids),
                             new_tokens_per_rank=[a - b for a, b in zip(after, before)],
                             cached_tokens_per_rank=before)
            r.metrics["steps"].append(_step_metrics("prefill", choice))
            if r.params.prompt_logprobs:
                r.prompt_lp = self._collect_prompt_lp(results, r)
            self._take_token(r, _pick(results, "last", r.seq_id), now)
        log.debug("prefill strategy %s (%s): %s", choice.strategy, choice.method, choice.inputs)

    def _decode(self, running: list[_Request]) -> None:
        works = []
        for r in running:
            counts = self.layout.tokens_per_rank(r.seq_id)
            order = [(counts[k], (k - r.decode_rank) % self.n) for k in range(self.n)]
            rank = min(range(self.n), key=lambda k: order[k])  # fewest tokens, then round-robin order
            r.decode_rank = (rank + 1) % self.n
            works.append(W.SeqWork(r.seq_id, (r.out[-1],), len(r.prompt) + len(r.out) - 1, decode_rank=rank))
        choice = choose_for_batch(self, works, "decode")
        results = self._run("decode", works, choice)
        now = time.perf_counter()
        for r in running:
            r.metrics["steps"].append(_step_metrics("decode", choice))
            self._take_token(r, _pick(results, "last", r.seq_id), now)

    def _take_token(self, r: _Request, logits: torch.Tensor, now: float) -> None:
        token, lp = sample(logits, r.params, r.generator)
        if r.out:
            r.metrics["ttit_s"].append(now - r.t_last)
        r.t_last = now
        r.out.append(token)
        r.logprobs.append(lp)
        eos = () if r.params.ignore_eos else self.config.eos_token_ids
        if token in eos or token in r.params.stop_token_ids:
            r.finish = "stop"
        elif len(r.out) >= r.params.max_tokens:
            r.finish = "length"

    def _collect_prompt_lp(self, results: list[dict], r: _Request) -> list[float | None]:
        lp: list[float | None] = [None] * len(r.prompt)
        for res in results:
            if r.seq_id in res["prompt_lp"]:
                offsets, values = res["prompt_lp"][r.seq_id]
                for o, v in zip(offsets.tolist(), values.tolist()):
                    lp[o + 1] = v
        return lp

    def _output(self, r: _Request) -> RequestOutput:
        text = self.tokenizer.decode(r.out) if self.tokenizer is not None else None
        return RequestOutput(r.prompt, list(r.out), text, list(r.logprobs) if r.params.logprobs else None,
                             r.prompt_lp, r.num_cached, r.finish or "length", r.metrics, r.seq_id)


def _pick(results: list[dict], key: str, seq_id: int):
    for res in results:
        if seq_id in res[key]:
            return res[key][seq_id]
    raise RuntimeError(f"no rank returned {key} for sequence {seq_id}")


def _step_metrics(phase: str, choice) -> dict:
    return {"phase": phase, "strategy": choice.strategy, "method": choice.method, "inputs": choice.inputs}


def _load_tokenizer(path: str):
    p = Path(path)
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError("the model has a tokenizer but `transformers` is not installed (pip install cpinfer[hf])") \
            from exc
    return AutoTokenizer.from_pretrained(str(p))
