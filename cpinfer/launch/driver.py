"""Rank 0 of a local pool hosted by the driver process itself (gloo on CPU): it joins the rank processes' world
from a background thread and holds this process's one default process group until it leaves."""
from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from cpinfer.launch.common import RankContext, bind_to_loopback

DRIVER_HOSTS = threading.Lock()  # held while a pool's rank 0 lives in this process (torch's default group)


def driver_can_host_rank() -> bool:
    """True when this process may be rank 0 of a new local pool: it holds no process group of its own (torch
    allows one default group per process) and no other pool's rank 0."""
    return not dist.is_initialized() and not DRIVER_HOSTS.locked()


class DriverRank:
    """Rank 0 of a pool, in this process: it joins the ranks' rendezvous in a background thread (so that a rank
    process that dies at start-up fails the pool instead of leaving this one waiting for the store's timeout) and
    holds this process's lock on the default process group until it has left it."""

    def __init__(self, store_path: str, world_size: int, threads: int | None, timeout_s: float):
        self._threads_before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        self.ctx: RankContext | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()  # orders the joiner's end against close()
        self._joined = threading.Event()
        bind_to_loopback()
        self._thread = threading.Thread(target=self._join, args=(store_path, world_size, timeout_s),
                                        name="cpinfer-rank0-join", daemon=True)
        self._thread.start()

    def _join(self, store_path: str, world_size: int, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=0, world_size=world_size, timeout=timeout)
            self.ctx = RankContext(0, world_size, dist.group.WORLD, dist.group.WORLD, torch.device("cpu"), {})
        except BaseException as exc:  # noqa: BLE001 - reported by wait_joined
            self._error = exc
        with self._lock:
            self._joined.set()
            if self._closed:  # the pool failed while this thread waited: leave and free the process's slot
                self._leave()

    def wait_joined(self, pool: "WorkerPool") -> None:
        """Once every rank process is ready, rank 0's group is ready too (or failed: raise)."""
        deadline = time.monotonic() + pool.timeout_s + 30.0
        while not self._joined.wait(0.1):
            if pool.dead_reason is not None or time.monotonic() > deadline:
                pool._fail("start-up")
        if self._error is not None:
            raise RuntimeError(f"rank 0 (this process) could not join the ranks: {self._error}") from self._error

    def _leave(self) -> None:
        if self.ctx is not None:
            self.ctx.state.clear()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer's connection is gone: nothing left to tear down
            pass
        torch.set_num_threads(self._threads_before)
        DRIVER_HOSTS.release()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._joined.is_set():  # else the joiner leaves when its wait ends
                self._leave()
