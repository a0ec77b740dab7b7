"""Local process launcher: start N ranks once, then run many functions on all of them (SPMD).

Used by tests, benchmarks and the local `LLM(...)` launcher. Each rank joins one gloo (CPU) or NCCL (GPU)
world; a function sent with `run` is called as `fn(ctx, *args)` on every rank and its per-rank results come
back in rank order. A rank that raises or dies fails the call on the driver instead of hanging it.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import signal
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpinfer.device import check_gpus, gpu_of_rank


@dataclasses.dataclass
class RankContext:
    """What a function running on one rank gets: its rank, the world, and the groups to pass down explicitly."""

    rank: int
    world_size: int
    group: Any  # the world process group (tensors)
    cpu_group: Any  # a gloo group for control metadata (same as `group` on CPU)
    device: torch.device
    state: dict  # per-rank scratch space that persists across `run` calls (e.g. an engine worker)


class RemoteError(RuntimeError):
    """A function raised on one or more ranks; `errors` maps rank → (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = errors
        first = min(errors)
        kind, msg, tb = errors[first]
        super().__init__(f"rank {first} raised {kind}: {msg}\n--- traceback of rank {first} ---\n{tb}")

    @property
    def exception_type(self) -> str:
        return self.errors[min(self.errors)][0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_parent_death_signal() -> None:
    """Ask Linux to kill this rank if the driver dies, so no orphan ranks are left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: rely on daemon processes
        pass


def _worker_main(rank, world_size, port, backend, threads, timeout_s, inbox, outbox, device_type="cpu"):
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C and shuts us down
    os.environ["RANK"] = str(rank)
    if threads:
        torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if device_type == "cuda":  # one GPU per rank (the pool checked there are enough), or shared over gloo
        device = gpu_of_rank(rank)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timeout
        )
        group = dist.group.WORLD
        cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        ctx = RankContext(rank, world_size, group, cpu_group, device, {})
        outbox.put((rank, "ready", None))
    except Exception as exc:  # noqa: BLE001 - report start-up failure to the driver
        outbox.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    while True:
        msg = inbox.get()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(ctx, *args, **kwargs)
            outbox.put((rank, "ok", result))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            outbox.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class WorkerPool:
    """N local ranks started once. `run(fn, *args)` calls `fn(ctx, *args)` on every rank and returns the results.

    `fn` must be importable by name (a module-level function). `timeout_s` bounds both the collectives inside
    the ranks and how long the driver waits for a call, so a dead or stuck rank fails the call instead of
    hanging forever.
    """

    def __init__(self, world_size: int, backend: str = "gloo", threads_per_rank: int | None = 1,
                 timeout_s: float = 300.0, device: str | None = None):
        """device: "cpu" or "cuda" (default: cuda for nccl, cpu for gloo); gloo with "cuda" puts several ranks on
        one GPU (their CUDA tensors go through host memory)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
        device = device or ("cuda" if backend == "nccl" else "cpu")
        if device not in ("cpu", "cuda") or (backend == "nccl" and device != "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (nccl needs 'cuda'), got {device!r} with {backend}")
        if device == "cuda":  # before any process starts: enough GPUs for one per rank unless gloo shares them
            check_gpus(world_size, share_gpus=backend == "gloo")
        self.world_size = world_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = []
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, backend, threads_per_rank, timeout_s, self._inboxes[rank], self._outbox,
                  device),
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self._closed = False
        self._collect(what="start-up")

    def _collect(self, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        deadline = self.timeout_s + 30.0
        waited = 0.0
        while len(results) + len(errors) < self.world_size:
            try:
                rank, status, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                if dead or waited > deadline:
                    self.close(force=True)
                    why = (f"rank(s) {dead} died (see their output above; a script that starts ranks needs an "
                           "`if __name__ == \"__main__\":` guard)") if dead else f"no answer after {deadline:.0f}s"
                    raise RuntimeError(f"worker pool failed during {what}: {why}; the pool was shut down")
                continue
            if status == "error":
                errors[rank] = payload
            else:
                results[rank] = payload
        if errors:
            raise RemoteError(errors)
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        """Call `fn(ctx, *args, **kwargs)` on every rank; results in rank order."""
        return self.run_each(fn, [args] * self.world_size, kwargs)

    def run_each(self, fn: Callable, args_per_rank: list[tuple], kwargs: dict | None = None) -> list[Any]:
        """Like `run`, with a different argument tuple for each rank."""
        if self._closed:
            raise RuntimeError("worker pool is closed")
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples, got {len(args_per_rank)}")
        for inbox, args in zip(self._inboxes, args_per_rank):
            inbox.put((fn, tuple(args), kwargs or {}))
        return self._collect(what=getattr(fn, "__name__", "call"))

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for inbox in self._inboxes:
                inbox.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [*self._inboxes, self._outbox]:  # release the queues now (never wait on a dead rank's pipe)
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)

    def __del__(self):
        try:
            self.close(force=True)
        except Exception:  # noqa: BLE001
            pass


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


def joined_world_requested() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _call(fn, ctx, args, kwargs):
    try:
        return ("ok", fn(ctx, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to rank 0
        return ("error", (type(exc).__name__, str(exc), traceback.format_exc()))


class JoinedWorld:
    """The same `run` interface as `WorkerPool`, over an existing torchrun world: rank 0 drives, the others serve.

    Rank 0 broadcasts each call over a gloo control group, runs it itself, and gathers every rank's result.
    The control group waits without a deadline-driven failure for idle periods (up to `idle_timeout_s`); the
    data groups keep `timeout_s`, and torchrun tears the job down if any rank dies.
    """

    def __init__(self, backend: str = "gloo", threads_per_rank: int | None = None, timeout_s: float = 300.0,
                 idle_timeout_s: float = 7 * 24 * 3600.0, device: str | None = None):
        if threads_per_rank:
            torch.set_num_threads(threads_per_rank)
        on_gpu = (device or ("cuda" if backend == "nccl" else "cpu")) == "cuda"
        device = torch.device("cpu")
        if on_gpu:  # LOCAL_RANK's GPU, after checking this node has one per rank (unless gloo shares them)
            check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), share_gpus=backend == "gloo")
            device = gpu_of_rank(int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))
        cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        self.ctx = RankContext(self.rank, self.world_size, dist.group.WORLD, cpu_group, device, {})
        self._closed = False

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        if self.rank != 0:
            raise RuntimeError("only rank 0 drives a joined world")
        msg = [(fn, args, kwargs)]
        dist.broadcast_object_list(msg, src=0, group=self._control)
        return self._finish(_call(fn, self.ctx, args, kwargs))

    def _finish(self, mine) -> list[Any]:
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._control)
        if self.rank != 0:
            return []
        errors = {r: payload for r, (status, payload) in enumerate(gathered) if status == "error"}
        if errors:
            raise RemoteError(errors)
        return [payload for _, payload in gathered]

    def serve_forever(self) -> None:
        """Ranks other than 0: run calls from rank 0 until it shuts down, then exit the process."""
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0, group=self._control)
            if msg[0] is None:
                break
            fn, args, kwargs = msg[0]
            self._finish(_call(fn, self.ctx, args, kwargs))
        dist.destroy_process_group()
        raise SystemExit(0)

    def close(self, force: bool = False) -> None:
        if self._closed or self.rank != 0:
            return
        self._closed = True
        dist.broadcast_object_list([None], src=0, group=self._control)
        dist.destroy_process_group()
