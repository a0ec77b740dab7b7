"""`LLMEngine`'s start-up (`EngineStartup`), in order: the model and tokenizer read and checked, the ranks started with
the weights loaded and attention warmed up, the persistent KV cache (paper §3.3) sized (host RAM on CPU; each GPU's
memory after a profiling forward on CUDA), its host / disk tiers opened and the KV manager made over them."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from cpinfer.attention.backends import _unusable as backend_problem
from cpinfer.attention.backends import resolve_name
from cpinfer.device import comm_backend, ranks_on_this_node
from cpinfer.engine import model_runner as MR
from cpinfer.engine import hybrid
from cpinfer.engine.kv.state_store import StateSlots
from cpinfer.engine.kv.capacity import kv_tokens_from_host_ram, profile_tokens_per_rank
from cpinfer.engine.kv.disk_dir import model_layout, open_disk_dir, rebuild_index
from cpinfer.engine.kv.fp8 import layout_dtype, per_token
from cpinfer.engine.kv.manager import BLOCK, KVManager, request_tokens_held
from cpinfer.engine.kv.placement import CostModel, Placer
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.engine.kv.tiers import TierConfig
from cpinfer.engine.sparse_attention import check_engine as check_sparse_engine
from cpinfer.engine.spec_decode.adaptive import verify_widths
from cpinfer.engine.spec_decode.draft import draft_for, draft_reserve_bytes, draft_token_bytes, load_draft
from cpinfer.engine.spec_decode.registry import check_method
from cpinfer.launch import (InProcessWorld, JoinedWorld, RemoteError, WorkerPool, driver_can_host_rank,
                            joined_world_requested)
from cpinfer.model.config import ModelConfig
from cpinfer.model.loader import checkpoint_files
from cpinfer.model.resolve import generation_defaults, resolve_model, resolve_tokenizer
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.models import load_model_spec
from cpinfer.utils import get_logger

log = get_logger()


class EngineStartup:
    """The steps of one engine's start-up; each sets the engine's attributes it owns from then on (model_path,
    config, tokenizer, the ranks' pool, kv, ...). An engine over other ranks (a P/D role: `pd/group.py`; a test's
    shared pool) subclasses it and overrides the steps that differ: `start_ranks`, `start_tiers`, `default_capacity`,
    `threads_per_rank`."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, model: str | None) -> None:
        """Everything before the engine can take requests; on a failure once ranks run, they are shut down."""
        e, a = self.engine, self.engine.args
        t0 = time.perf_counter()
        self.read_model(model)
        capacity = self.initial_capacity()
        if capacity is not None:  # given or a share of RAM: max_model_len is checked against it before ranks start
            self.fit_max_model_len(capacity)
        # "auto" resolves here ($CPINFER_ATTENTION_BACKEND, installed packages), so a bad choice fails before ranks
        # start; the ranks resolve it again on their devices (torch-flash's probe runs there) and report the result
        e.attention_backend = resolve_name(a.attention_backend, torch.device(a.device), probe=False)
        e.attention_timings_ms = {}  # backend → ms of `auto`'s timing on rank 0 (empty: not timed)
        self.read_tokenizer()
        log.info("start-up: model: %s, config and tokenizer read in %.1f s", e.model_path, time.perf_counter() - t0)
        e.draft = draft_for(a, e.config, e.tokenizer)  # a draft model (path, config), checked; or None
        if e.draft is not None and a.max_kv_tokens_per_rank is None and a.device == "cpu":
            capacity = self.default_capacity(a.kv_memory_fraction) // BLOCK * BLOCK  # its store counted too
        capacity = self.start_ranks(capacity)
        e.disk = None  # the opened disk-tier directory
        try:
            self.fit_max_model_len(capacity)  # measured on the GPUs (or a draft's share of RAM): checked now
            if e.draft is not None:
                self.load_draft()
            self.make_kv(capacity, self.start_tiers())
        except BaseException:
            e.shutdown()
            raise

    def load_draft(self) -> None:
        """The draft model on every rank beside the target (its store sized by the target's)."""
        load_draft(self.engine)

    # ------------------------------------------------------------------ before any rank starts
    def read_model(self, model: str | None) -> None:
        """The model's directory and config, checked against the arguments (every error before a rank starts)."""
        e, a = self.engine, self.engine.args
        # None → the embedded default; .gguf → converted once; load_format "dummy" needs no weight files
        e.model_path = str(resolve_model(model, weights=a.load_format == "auto", revision=a.revision,
                                         download_dir=a.download_dir))
        e.config = ModelConfig.from_pretrained(e.model_path)  # validates the directory before starting ranks
        if per_token(a.kv_cache_dtype) and e.config.values_in_keys:
            raise ValueError(f"kv_cache_dtype={a.kv_cache_dtype!r} is not supported for {e.config.model_type} "
                             "(multi-head latent attention: the values are the cached latent's first channels); use "
                             "kv_cache_dtype='fp8' (static scales)")
        hybrid.check(e.config, a, pd_role=hasattr(e, "view"))  # features that do not carry recurrent states yet
        check_sparse_engine(e.config, a, getattr(e, "role", None))  # DSA: what its indexer keys do not reach yet
        if a.load_format == "auto":
            checkpoint_files(Path(e.model_path))  # raises ValueError when no weights are there
        if a.speculative_config is not None:
            check_method(a.speculative_config)  # a method this build lacks fails before any rank starts
        e.n = a.context_parallel_size
        e.parallel = a.parallel
        e.parallel.check_model(e.config.num_attention_heads, e.config.num_key_value_heads)
        if a.tensor_parallel_size > 1 and e.config.tensor_parallel_refusal:
            raise ValueError(f"tensor_parallel_size {a.tensor_parallel_size} is not supported for model_type "
                             f"{e.config.model_type!r}: {e.config.tensor_parallel_refusal}; use context parallelism")
        if e.config.intermediate_size % a.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {a.tensor_parallel_size} must divide intermediate_size "
                             f"({e.config.intermediate_size})")
        trained = e.config.max_position_embeddings
        e.max_model_len = a.max_model_len or trained
        e.max_model_len_note = f"the model's max_position_embeddings is {trained}"  # why it is what it is
        e.max_logprobs = e.config.vocab_size if a.max_logprobs == -1 else a.max_logprobs
        if e.max_model_len > trained:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d: quality beyond the "
                        "trained context is not guaranteed", e.max_model_len, trained)
        e.strategy = a.strategy
        # a catalog name or a `cpinfer calibrate` JSON; loaded now so a bad path fails before any rank starts
        e.hardware = load_hardware_profile(a.hardware_profile or ("cpu-gloo" if a.device == "cpu" else "h100-gtt"))
        e.elem_bytes = getattr(torch, a.dtype).itemsize

    def fit_max_model_len(self, capacity: int) -> None:
        """A max_model_len the KV cache cannot hold for one request (`capacity` tokens per rank over this engine's CP
        ranks, as the KV manager counts blocks) is refused when the user set it, else lowered to what the cache holds,
        with a warning (as vLLM): every request within max_model_len then fits an empty cache."""
        e, a = self.engine, self.engine.args
        holds = request_tokens_held(e.n, capacity)
        if e.max_model_len <= holds:
            return
        where = self.capacity_where()
        cache = (f"{capacity} KV tokens per rank x CP {e.n}{where} hold at most {holds} tokens for one request "
                 f"(prompt + output)")
        more = "raise max_kv_tokens_per_rank" if a.max_kv_tokens_per_rank is not None else (
            "raise gpu_memory_utilization" if a.device == "cuda" else
            "set max_kv_tokens_per_rank (the default is kv_memory_fraction of RAM)")
        if holds < 2:
            raise ValueError(f"the KV cache holds no request: {cache}; {more} or context_parallel_size")
        if a.max_model_len is not None:
            raise ValueError(f"max_model_len {e.max_model_len} does not fit the KV cache: {cache}; lower max_model_len "
                             f"to {holds} or less, or {more} or context_parallel_size")
        log.warning("max_model_len lowered from %d (the model's max_position_embeddings) to %d: %s; %s or "
                    "context_parallel_size to serve the model's whole context", e.max_model_len, holds, cache, more)
        e.max_model_len = holds
        e.max_model_len_note = (f"what the KV cache holds for one request; the model's max_position_embeddings is "
                                f"{e.config.max_position_embeddings}")

    def capacity_where(self) -> str:
        """Which ranks a capacity message speaks of ("" for the engine's own; a P/D role names its group)."""
        return ""

    def read_tokenizer(self) -> None:
        """The tokenizer (the model's own, or the one named) and the checkpoint's generation defaults."""
        e, a = self.engine, self.engine.args
        tokenizer_dir = e.model_path if a.tokenizer is None else str(
            resolve_tokenizer(a.tokenizer, download_dir=a.download_dir))
        e.tokenizer = load_tokenizer(tokenizer_dir)
        e.generation_defaults = generation_defaults(e.model_path, a.generation_config)

    def initial_capacity(self) -> int | None:
        """KV tokens per rank, in whole blocks: as given, or (CPU) a share of host RAM; None: measured on the GPUs."""
        a = self.engine.args
        capacity = a.max_kv_tokens_per_rank
        if capacity is None and a.device == "cpu":
            capacity = self.default_capacity(a.kv_memory_fraction)
        if capacity is not None and self.engine.config.hybrid:  # the state cache is paid from the same budget
            capacity -= self.state_tokens()
            if capacity < BLOCK:
                raise ValueError(f"max_kv_tokens_per_rank leaves no room for K/V after the recurrent state cache of this "
                                 f"hybrid model ({self.state_tokens()} tokens' worth per rank for "
                                 f"{hybrid.state_slots(a.max_num_seqs)} state slots): raise it or lower max_num_seqs")
        return None if capacity is None else capacity // BLOCK * BLOCK

    def state_tokens(self) -> int:
        """Hybrid models: the KV tokens per rank the state cache's bytes are worth (counted in the capacity)."""
        e = self.engine
        c = e.config
        token = KVStore.bytes_per_token(c.num_kv_layers, c.cached_kv_heads, KVWidths.of(c), e.elem_bytes,
                                        e.args.kv_cache_dtype)
        return -(-hybrid.state_bytes(c, e.elem_bytes, e.args.max_num_seqs) // token)

    def default_capacity(self, fraction: float) -> int:
        """KV tokens per rank in `fraction` of host RAM, split over the CP ranks (a draft's store counted too)."""
        e = self.engine
        c = e.config
        per_token_bytes = KVStore.bytes_per_token(c.num_kv_layers, c.cached_kv_heads, KVWidths.of(c),
                                                  e.elem_bytes, e.args.kv_cache_dtype)
        per_token_bytes += draft_token_bytes(getattr(e, "draft", None), e.elem_bytes)  # a draft's store: same slots
        return kv_tokens_from_host_ram(fraction, e.n, per_token_bytes, BLOCK, e.max_model_len)

    def threads_per_rank(self) -> int:
        e = self.engine
        return e.args.threads_per_rank or max(1, (os.cpu_count() or 1) // e.parallel.world_size)

    def memory_sizing(self, tokens: int, ranks_here: int) -> dict:
        """What each rank measures when the KV cache is sized from GPU memory (`model_runner.measure_kv`): a
        profiling forward of `tokens`, the memory utilization, the ranks sharing a GPU, and a draft model's bytes
        (it loads after the measurement: its store holds the target's slots, plus its weights and scratch rows)."""
        e = self.engine
        a, draft = e.args, getattr(e, "draft", None)
        return {"tokens": tokens, "utilization": a.gpu_memory_utilization, "block": BLOCK,
                "ranks_per_device": -(-ranks_here // max(1, torch.cuda.device_count())),
                "extra_bytes_per_token": draft_token_bytes(draft, e.elem_bytes),
                "reserve_bytes": draft_reserve_bytes(a, draft, e.elem_bytes)
                + (hybrid.state_bytes(e.config, e.elem_bytes, a.max_num_seqs) if e.config.hybrid else 0)}

    def decode_config(self, comm: str) -> dict:
        """The ranks' decode path: {"mode": "graph" (CUDA graphs per batch-size bucket), "eager" (the same static
        path without capture) or "off" (the dynamic path), "max_rows": the largest bucket, "verify": how drafts are
        verified (`spec_verify`: "decode" puts verify rows on the static path), "verify_width": the most rows of one
        verify sequence (k + 1), "verify_widths": those the static path captures (k + 1 of each of the
        adaptive k's draft sizes: `spec_decode/adaptive.py`)}. `comm`: the tensors'
        torch.distributed backend (a gloo collective cannot be captured in a CUDA graph)."""
        e = self.engine
        a = e.args
        graphs = a.device == "cuda" and not a.enforce_eager
        static = graphs if a.static_decode is None else a.static_decode
        if static and backend_problem("triton", torch.device(a.device)):
            log.warning("CUDA graphs for decode are off: their attention is the Triton kernel, and %s",
                        backend_problem("triton", torch.device(a.device)))
            static = False
        if graphs and static and comm == "gloo" and e.parallel.world_size > 1:
            log.warning("decode runs without CUDA graphs: its collectives go over gloo (ranks sharing a GPU), which "
                        "a graph cannot capture")
            graphs = False
        widths = KVWidths.of(e.config)
        if static and widths.key != widths.value and not widths.values_in_keys and a.static_decode is None:
            log.warning("decode runs without the static path (CUDA graphs): it takes one head size for keys and "
                        "values (or values inside the keys, as MLA's), and this model's differ")
            static = False
        if static and a.kv_cache_dtype != "auto":
            log.warning("decode runs without the static path (CUDA graphs): it reads a full-precision KV cache, and "
                        "kv_cache_dtype is %s", a.kv_cache_dtype)
            static = False
        mode = "off" if not static else "graph" if graphs else "eager"
        spec = a.speculative_config
        return {"mode": mode, "max_rows": a.max_num_seqs, "verify": a.spec_verify,
                "verify_width": 1 + (spec.num_speculative_tokens if spec is not None else 0),
                "verify_widths": verify_widths(spec.num_speculative_tokens) if spec is not None else (1,)}

    # ------------------------------------------------------------------ the ranks
    def start_ranks(self, capacity: int | None) -> int:
        """Start the ranks (`engine._pool`), load the model and warm attention up; with capacity None (CUDA), size
        the KV cache from each GPU's memory. Returns the KV capacity per rank."""
        e, a = self.engine, self.engine.args
        world = e.parallel.world_size
        ranks_here = ranks_on_this_node(world)
        backend = comm_backend(a.device, ranks_here, a.share_gpus)
        if a.device == "cuda" and backend == "gloo":
            log.warning("%d ranks share %d GPU(s): tensors go over gloo through host memory (slow; for checks)",
                        ranks_here, torch.cuda.device_count())
        t0 = time.perf_counter()
        self._make_pool(world, backend)
        sizing = None if capacity is not None else self.memory_sizing(
            profile_tokens_per_rank(a.max_num_batched_tokens, e.max_model_len, e.n), ranks_here)
        try:
            if isinstance(e._pool, JoinedWorld) and e._pool.rank != 0:
                e._pool.serve_forever()  # never returns: the process exits when rank 0 shuts down
            log.info("start-up: ranks: %d (CP %d x TP %d) on %s over %s started in %.1f s", world, e.n,
                     a.tensor_parallel_size, a.device, backend, time.perf_counter() - t0)
            return self._load_ranks(capacity, sizing, backend)
        except RemoteError as exc:  # e.g. a missing or mis-shaped tensor: the loader's message, as ValueError
            e._pool.close(force=True)
            if exc.exception_type == "ValueError":
                raise ValueError(exc.errors[min(exc.errors)][1]) from None
            raise
        except BaseException:
            e._pool.close(force=True)
            raise

    def _make_pool(self, world: int, backend: str) -> None:
        e, a = self.engine, self.engine.args
        if joined_world_requested():  # under torchrun: join it; only rank 0 comes back from here
            e._pool = JoinedWorld(backend, a.threads_per_rank, a.timeout_s, device=a.device)
            e.parallel.check_world(e._pool.world_size)
            return
        threads = self.threads_per_rank()
        if world == 1 and a.in_process:  # one rank: run it in this process, no IPC per step
            e._pool = InProcessWorld(a.device, threads, a.timeout_s)
            return
        # on CPU rank 0 runs here too (no IPC for what it does alone), unless this process hosts another
        driver = a.in_process and (a.device, backend) == ("cpu", "gloo") and driver_can_host_rank()
        e._pool = WorkerPool(world, backend=backend, threads_per_rank=threads, timeout_s=a.timeout_s,
                             device=a.device, driver_rank=driver)

    def _load_ranks(self, capacity: int | None, sizing: dict | None, backend: str) -> int:
        """Every rank loads the model (attention warmed up) and allocates its KV store, at `capacity` or at the
        smallest that every rank measured."""
        e, a = self.engine, self.engine.args
        infos = e._pool.run(MR.init_runner, e.model_path, a.dtype, capacity, e.n, a.tensor_parallel_size,
                            a.attention_backend, sizing, self.decode_config(backend), a.kv_cache_dtype,
                            a.load_format)  # each rank resolves the attention backend on its device
        _log_start_stages(infos, a.dtype, a.load_format)
        e.rank_pids = [i["pid"] for i in infos]
        e.attention_backend = infos[0].get("attention_backend", e.attention_backend)  # what rank 0 runs
        e.attention_timings_ms = infos[0].get("attention_timings_ms", {})  # how auto chose it, if it timed
        if capacity is None:
            capacity = min(i["kv_capacity"] for i in infos)  # every rank holds the same number of slots
            e._pool.run(MR.allocate_kv, capacity)
            _log_gpu_capacity(capacity, infos, sizing)
        log.info("start-up: KV cache: %d tokens per CP rank (%.1f MiB each) sized and allocated in %.1f s",
                 capacity, capacity * e.kv_bytes_per_token / (1 << 20), max(i.get("kv_s", 0.0) for i in infos))
        return capacity

    # ------------------------------------------------------------------ the KV cache over its tiers
    def start_tiers(self) -> TierConfig | None:
        """Host pools and disk writers on the ranks, and the disk directory (`engine.disk`), when asked for (None:
        no tiers)."""
        e, a = self.engine, self.engine.args
        if not a.kv_host_gib and a.kv_disk_dir is None:
            return None
        if not a.enable_prefix_caching:
            log.warning("kv_host_gib / kv_disk_dir need prefix caching, which is off: no KV tiers")
            return None
        per_rank = e._pool.run(MR.kv_token_bytes)  # one token's bytes on each rank (its TP share of heads)
        host_slots = int(a.kv_host_gib * (1 << 30)) // max(per_rank)
        if a.kv_host_gib and host_slots < BLOCK:
            raise ValueError(f"kv_host_gib {a.kv_host_gib} holds fewer than {BLOCK} tokens per rank "
                             f"({max(per_rank)} bytes each)")
        token_bytes = sum(per_rank[:a.tensor_parallel_size])  # a CP rank's token over its TP ranks
        layout, disk_dir, disk_bytes = None, None, 0
        c = e.config
        if a.kv_disk_dir is not None:
            e.disk = open_disk_dir(a.kv_disk_dir, a.kv_disk_gib)
            layout = model_layout(e.model_path, checkpoint_files(Path(e.model_path)), e.disk,
                                  layout_dtype(a.dtype, a.kv_cache_dtype), c.num_hidden_layers, c.cached_kv_heads,
                                  c.kv_key_width + KVWidths.of(c).index, a.tensor_parallel_size, c.kv_row)
            disk_dir, disk_bytes = str(e.disk.path), e.disk.bound
        writable = e.disk is not None and e.disk.writable
        shared = c.values_in_keys and a.tensor_parallel_size > 1  # MLA: one latent copy per CP shard
        # hybrid models: the host tier keeps as many recurrent-state snapshots as the device (replicated per rank)
        host_states = hybrid.state_slots(a.max_num_seqs) if c.hybrid and host_slots else 0
        state_bytes = hybrid.state_bytes_per_slot(c, e.elem_bytes) if c.hybrid else 0
        e._pool.run(MR.init_tiers, host_slots, disk_dir, writable, layout, e.n, shared, host_states)
        once = per_rank[0] if c.values_in_keys else 0  # the latent counted once, not per TP rank
        config = TierConfig(host_slots, disk_dir, disk_bytes, token_bytes, layout, a.tensor_parallel_size,
                            writable=writable, disk_token_bytes=once, host_token_bytes=once,
                            host_state_slots=host_states, state_bytes=state_bytes)
        log.info("KV tiers: host %s, disk %s", f"{host_slots} tokens per rank" if host_slots else "off",
                 f"{disk_dir} (bound {disk_bytes / (1 << 30):.2f} GiB)" if disk_dir else "off")
        return config

    def make_kv(self, capacity: int, tiers: TierConfig | None) -> None:
        """The engine's KV manager (`engine.kv`) of `capacity` slots per rank over these tiers, its disk tier's
        index rebuilt from the directory."""
        e, a = self.engine, self.engine.args
        driver_rank = getattr(e._pool, "driver_rank", False)  # rank 0 in this process: it takes local work
        e.kv = KVManager(e.n, capacity, a.enable_prefix_caching, self.placer(), tiers,
                         preferred_rank=0 if driver_rank and e.parallel.tp == 1 else None)
        if e.config.hybrid:  # a live state slot per running request, the rest for snapshots (kv/state_store.py)
            e.kv.enable_states(StateSlots(hybrid.state_slots(a.max_num_seqs)), a.state_snapshot_interval)
        if e.disk is not None:
            rebuild_index(e.kv, e.disk, tiers.layout)

    def placer(self) -> Placer:
        """The placement policy; "auto" predicts costs for this model on the engine's hardware profile. CPU ranks
        share the machine: one runs at its threads' share of the cores (the profile describes the whole machine)."""
        e, a = self.engine, self.engine.args
        if a.placement != "auto" or e.n == 1:
            return Placer(a.placement, e.n)
        if e.config.hybrid:  # the cost model does not know the recurrent layers yet: every prompt 2N-sharded
            log.info("placement auto: hybrid model, no cost model for its recurrent layers yet: placement 'shard'")
            return Placer("shard", e.n)
        share = 1.0
        if a.device == "cpu":
            cores = os.cpu_count() or 1
            here = ranks_on_this_node(e.parallel.world_size)
            share = min(1.0, min(self.threads_per_rank(), cores / here) / cores)
        model = CostModel(load_model_spec(e.model_path), e.hardware, e.n, a.tensor_parallel_size, e.elem_bytes, share)
        return Placer("auto", e.n, model)


def _log_start_stages(infos: list[dict], dtype: str, load_format: str) -> None:
    """The weights and warm-up stages of start-up, with the slowest rank's time."""
    what = "random weights (load_format dummy)" if load_format == "dummy" else "weights"
    log.info("start-up: %s: loaded in %s on every rank in %.1f s", what, dtype,
             max(i.get("load_s", 0.0) for i in infos))
    log.info("start-up: warm-up: attention backend %s ready in %.1f s", infos[0].get("attention_backend"),
             max(i.get("warmup_s", 0.0) for i in infos))


def _log_gpu_capacity(capacity: int, infos: list[dict], sizing: dict) -> None:
    m = infos[0]["memory"]
    gib = float(1 << 30)
    log.info("KV cache: %d tokens per rank (%.2f GiB each), from gpu_memory_utilization %.2f of %.1f GiB per GPU "
             "(%d rank(s) per GPU) after the weights and a profiling forward of %d tokens per rank peaked at "
             "%.2f GiB (rank 0; %.2f GiB were in use before loading); per-rank limits %s",
             capacity, capacity * infos[0]["kv_bytes_per_token"] / gib, sizing["utilization"], m["total"] / gib,
             sizing["ranks_per_device"], sizing["tokens"], m["peak"] / gib, (m["total"] - m["free_at_start"]) / gib,
             [i["kv_capacity"] for i in infos])


def load_tokenizer(path: str):
    """The tokenizer in a model folder (transformers' AutoTokenizer), or None when the folder has none."""
    p = Path(path)
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))
