"""A world of one rank that is this process: `run` calls the function right here, with no second process and
no message per call (the engine's CP1 x TP1)."""
from __future__ import annotations

import traceback
from typing import Any, Callable

import torch

from cpinfer.launch.common import RankContext, RemoteError


class InProcessWorld:
    """World size 1 without a second process: `run(fn)` calls `fn(ctx)` right here (no IPC per call).

    A single rank needs no collective, so `ctx.group` is None; the engine uses this for CP1 × TP1, where the
    round trip to a rank process would be a large share of a decode step. Sets this process's torch threads.
    """

    def __init__(self, device: str = "cpu", threads: int | None = None, timeout_s: float = 300.0):
        if threads:
            torch.set_num_threads(threads)
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.world_size, self.timeout_s = 1, timeout_s
        self.dead_reason: str | None = None  # the rank is this process: it cannot die alone
        self.ctx = RankContext(0, 1, None, None, dev, {})
        self._closed = False

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        if self._closed:
            raise RuntimeError("worker pool is closed")
        try:
            return [fn(self.ctx, *args, **kwargs)]
        except Exception as exc:  # the same error shape as a remote rank's
            raise RemoteError({0: (type(exc).__name__, str(exc), traceback.format_exc())}) from exc

    def run_each(self, fn: Callable, args_per_rank: list[tuple], kwargs: dict | None = None) -> list[Any]:
        if len(args_per_rank) != 1:
            raise ValueError(f"need 1 argument tuple, got {len(args_per_rank)}")
        return self.run(fn, *args_per_rank[0], **(kwargs or {}))

    def close(self, force: bool = False) -> None:
        self._closed = True
        self.ctx.state.clear()

    def __enter__(self) -> "InProcessWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
