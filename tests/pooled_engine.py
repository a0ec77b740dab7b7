"""An `LLM` whose ranks live in a shared, already started `WorkerPool` (tests only).

Spawning ranks dominates the time of a multi-process engine test, so one pool per world size serves engines of
many checkpoints in turn: each engine re-initialises the ranks' model runner (`init_runner`) with its own model
and leaves the pool running when it shuts down. The driver side (scheduler, KV manager) is the real `LLMEngine`.
"""
from __future__ import annotations

import itertools

from cpinfer.engine import model_runner as MR
from cpinfer.engine.llm import LLM
from cpinfer.engine.llm_engine import LLMEngine


class _PooledEngine(LLMEngine):
    def __init__(self, model, pool, **kwargs):
        self._shared_pool = pool
        super().__init__(model, **kwargs)

    def _start_ranks(self, capacity: int) -> int:
        if self._shared_pool.world_size != self.parallel.world_size:
            raise ValueError(f"the pool has {self._shared_pool.world_size} ranks, the engine needs "
                             f"{self.parallel.world_size}")
        self._pool = self._shared_pool
        infos = self._pool.run(MR.init_runner, self.model_path, self.args.dtype, capacity, self.n,
                               self.args.tensor_parallel_size, self.attention_backend, None,
                               self.decode_config("gloo"), self.args.kv_cache_dtype)
        self.rank_pids = [i["pid"] for i in infos]
        return capacity

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
