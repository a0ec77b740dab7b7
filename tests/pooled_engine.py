"""An `LLM` whose ranks live in a shared, already started `WorkerPool` (tests only).

Spawning ranks dominates the time of a multi-process engine test, so one pool per world size serves engines of
many checkpoints in turn: each engine re-initialises the ranks' model runner (`init_runner`) with its own model
(its start-up's `start_ranks`) and leaves the pool running when it shuts down. The driver side (scheduler, KV
manager) is the real `LLMEngine`.
"""
from __future__ import annotations

import itertools

from cpinfer.engine import model_runner as MR
from cpinfer.engine.llm import LLM
from cpinfer.engine.llm_engine import LLMEngine
from cpinfer.engine.startup import EngineStartup


class _PooledStartup(EngineStartup):
    def start_ranks(self, capacity: int) -> int:
        e = self.engine
        if e._shared_pool.world_size != e.parallel.world_size:
            raise ValueError(f"the pool has {e._shared_pool.world_size} ranks, the engine needs "
                             f"{e.parallel.world_size}")
        e._pool = e._shared_pool
        infos = e._pool.run(MR.init_runner, e.model_path, e.args.dtype, capacity, e.n, e.args.tensor_parallel_size,
                            e.attention_backend, None, self.decode_config("gloo"), e.args.kv_cache_dtype)
        e.rank_pids = [i["pid"] for i in infos]
        return capacity


class _PooledEngine(LLMEngine):
    startup_class = _PooledStartup

    def __init__(self, model, pool, **kwargs):
        self._shared_pool = pool
        super().__init__(model, **kwargs)

    def shutdown(self) -> None:
        if getattr(self, "_pool", None) is not None and self.dead_error is None:
            self.flush_tiers()  # disk writes finish, as in a real shutdown
        self._pool = None  # the pool outlives the engine; its owner closes it
        if getattr(self, "disk", None) is not None:
            self.disk.close()
            self.disk = None


class PooledLLM(LLM):
    """`LLM(model, **kwargs)` on the ranks of `pool` (a `WorkerPool` of context × tensor parallel size ranks)."""

    def __init__(self, model, pool, **kwargs):
        self.engine = _PooledEngine(model, pool, **kwargs)
        self._ids = itertools.count()


def shard_engines():
    """A module fixture's body: yields `get(path, cp, tp=1, **kw)`, an engine with placement "shard" and one thread
    per rank — CP1 x TP1 in the driver, more ranks on a pool of that size shared by the module (closed at the end)."""
    from cpinfer.launch import WorkerPool

    pools: dict[int, WorkerPool] = {}

    def get(path, cp, tp=1, **kw):
        kw = dict(context_parallel_size=cp, tensor_parallel_size=tp, placement="shard", threads_per_rank=1, **kw)
        world = cp * tp
        if world == 1:
            return LLM(str(path), **kw)
        if world not in pools:
            pools[world] = WorkerPool(world, threads_per_rank=1, timeout_s=120)
        return PooledLLM(str(path), pools[world], **kw)

    try:
        yield get
    finally:
        for pool in pools.values():
            pool.close()


def keyed_engines(**defaults):
    """A module fixture's body for modules that ask for many (checkpoint, CP, options) engines: yields
    `get(path, cp, tp=1, **kw)`, the LLM of those arguments (`defaults` under `kw`), made on first use and reused
    while it is its pool's newest. CP1 x TP1 runs in the driver process (one LLM per key, kept for the module); more
    ranks run on one `WorkerPool` per world size, spawned once for the module (rank 0 in the driver when this
    process can host it, as a real engine's pool would be). A pool serves one engine at a time: asking for other
    arguments on the same world size shuts the previous engine down first (its K/V goes with it)."""
    from cpinfer.launch import WorkerPool, driver_can_host_rank

    local: dict[tuple, LLM] = {}
    pools: dict[int, WorkerPool] = {}
    current: dict[int, tuple] = {}  # world size -> (key, the engine on that pool now)

    def get(path, cp, tp=1, **kw):
        kw = dict(context_parallel_size=cp, tensor_parallel_size=tp, **{**defaults, **kw})
        key = (str(path), tuple(sorted(kw.items())))
        world = cp * tp
        if world == 1:
            if key not in local:
                local[key] = LLM(str(path), **kw)
            return local[key]
        if world in current and current[world][0] == key and current[world][1].engine._pool is not None:
            return current[world][1]  # (not when a test has shut it down itself)
        if world in current:
            current.pop(world)[1].shutdown()
        if world not in pools:
            pools[world] = WorkerPool(world, threads_per_rank=kw.get("threads_per_rank", 1),
                                      timeout_s=kw.get("timeout_s", 120), driver_rank=driver_can_host_rank())
        llm = PooledLLM(str(path), pools[world], **kw)
        current[world] = (key, llm)
        return llm

    try:
        yield get
    finally:
        for llm in [*local.values(), *(llm for _, llm in current.values())]:
            llm.shutdown()
        for pool in pools.values():
            pool.close()


def pd_llm(pool, path, **kwargs) -> LLM:
    """An `LLM` over a prefill / decode engine whose world is the shared `pool` (its size must be the P/D world's:
    (N + K·M) × TP); one rank thread each. The pool outlives the engine."""
    from cpinfer.engine.pd import PDEngine

    class _PooledPD(PDEngine):
        def _make_pool(self, world, backend, threads):
            if world != pool.world_size:
                raise ValueError(f"the pool has {pool.world_size} ranks, the P/D world needs {world}")
            return pool

        def shutdown(self) -> None:
            # the ranks serve the module's next engine: nothing of this one may still be on its way there (a call
            # whose reply the next engine would read, sends without their receives). Every request is aborted and
            # the engine stepped until idle (transfers and moved-back answers in), with a bound; what is still in
            # flight after all (a failure) is abandoned: the pool drops its late replies.
            from wait_utils import settle

            try:
                if self._pool is not None and self.dead_error is None:
                    for rid in list(self.requests):
                        self.abort(rid)
                    settle(self)
            finally:
                self._abandon_inflight()
                for g in self.groups:
                    g.shutdown()
                self._pool = None  # the module's pool outlives the engine

    llm = LLM.__new__(LLM)
    llm.engine = _PooledPD(str(path), threads_per_rank=1, **kwargs)
    llm._ids = itertools.count()
    return llm
