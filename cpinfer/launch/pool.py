"""`WorkerPool`: N local rank processes started once, then many functions run on all or some of them (SPMD),
with a watcher that sees a dead rank at once; on CPU rank 0 may be the driver process itself (`driver.py`).
"""
from __future__ import annotations

import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from cpinfer.device import check_gpus
from cpinfer.launch.calls import START_UP, CallBook
from cpinfer.launch.common import RemoteError, rank_death
from cpinfer.launch.driver import DRIVER_HOSTS, DriverRank
from cpinfer.launch.rank import worker_main

_POOLS = {"open": set(), "tracker": False}  # this process's open pools; whether one of them started
# multiprocessing's resource tracker (then it is stopped when the last pool closes)


def _tracker_running() -> bool:
    return getattr(multiprocessing.resource_tracker._resource_tracker, "_fd", None) is not None


def _stop_tracker() -> None:
    """Stop and join multiprocessing's resource tracker, a helper process spawning the ranks started: else it
    outlives this process and shows as defunct until init reaps it."""
    stop = getattr(multiprocessing.resource_tracker._resource_tracker, "_stop", None)
    if stop is not None and _tracker_running():
        try:
            stop()
        except Exception:  # noqa: BLE001 - a helper's exit: nothing to save
            pass


class WorkerPool:
    """N local ranks started once. `run(fn, *args)` calls `fn(ctx, *args)` on every rank and returns the results.

    `fn` must be importable by name (a module-level function). `timeout_s` bounds both the collectives inside
    the ranks and how long the driver waits for a call, so a stuck rank fails the call instead of hanging
    forever; a rank that exits fails the call (and sets `dead_reason`) at once, and when some ranks raised while
    the others have not answered `fail_grace_s` later, those are stuck waiting for them: the pool is killed.

    Each rank joins one gloo (CPU) or NCCL (GPU) world through a private FileStore and binds its sockets to
    loopback only; a message to a rank process is pickled onto a pipe of its own.

    `driver_rank=True` (gloo on CPU only) makes this process rank 0: its share of a call runs in the calling
    thread, without the pickle, pipe and process wake-ups of a round trip (about half a millisecond, a large share
    of a short decode step), and a call only on rank 0 needs no message at all. Rank 0 then holds torch's default
    process group, so one such pool at a time per process (`driver_can_host_rank`). A rank process that raises
    while rank 0 waits for it in a collective rings an alarm: the watcher kills the rank processes after
    `fail_grace_s`, which ends rank 0's collective at once (gloo sees the closed connections), and the call raises
    the rank's own error.

    Every call carries an id and every reply the id of the call it answers (`calls.CallBook`): a reply to a call
    that was abandoned, superseded or never collected is dropped with a warning, never returned to another call.
    """

    def __init__(self, world_size: int, backend: str = "gloo", threads_per_rank: int | None = 1,
                 timeout_s: float = 300.0, fail_grace_s: float = 2.0, device: str | None = None,
                 driver_rank: bool = False):
        """device: "cpu" or "cuda" (default: cuda for nccl, cpu for gloo); gloo with "cuda" puts several ranks on
        one GPU (their CUDA tensors go through host memory)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
        device = device or ("cuda" if backend == "nccl" else "cpu")
        if device not in ("cpu", "cuda") or (backend == "nccl" and device != "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (nccl needs 'cuda'), got {device!r} with {backend}")
        if driver_rank and (backend, device) != ("gloo", "cpu"):
            raise ValueError(f"driver_rank needs gloo on CPU, got {backend} on {device}")
        if device == "cuda":  # before any process starts: enough GPUs for one per rank unless gloo shares them
            check_gpus(world_size, share_gpus=backend == "gloo")
        if driver_rank and not (DRIVER_HOSTS.acquire(blocking=False)):
            raise RuntimeError("this process already hosts rank 0 of another worker pool (close it first)")
        if driver_rank and dist.is_initialized():
            DRIVER_HOSTS.release()
            raise RuntimeError("this process already has a torch.distributed process group: it cannot be rank 0 "
                               "of a worker pool (use driver_rank=False)")
        self.world_size = world_size
        self.timeout_s, self.fail_grace_s = timeout_s, fail_grace_s
        self.dead_reason: str | None = None  # set by the watcher when a rank exits unasked
        ctx = mp.get_context("spawn")
        _POOLS["tracker"] = _POOLS["tracker"] or not _tracker_running()  # the spawns below start it
        _POOLS["open"].add(id(self))
        self._store_dir = tempfile.mkdtemp(prefix="cpinfer-rdzv-")  # private (0700): the ranks' rendezvous file
        store_path = os.path.join(self._store_dir, "store")
        # one pipe each way per rank process: a message is pickled and written by the thread that sends it (no
        # feeder thread to wake up), which is most of a decode step's driver <-> rank round trip
        self._inboxes: dict[int, Any] = {}
        self._outboxes: dict[int, Any] = {}
        self._alarms: dict[int, Any] = {}  # driver_rank: a rank process that raised writes a byte here
        self._proc_of: dict[int, Any] = {}
        self._closed = self._closing = False
        self._driver: DriverRank | None = None  # rank 0, when it is this process
        self._driver_call = 0  # driver_rank: the id of the call rank 0 is in, from its first send (0: none)
        self._book = CallBook()  # the calls in flight: which reply each rank owes (stale ones are dropped)
        self._alarmed: int | None = None  # the rank whose error made the watcher end the pool
        self._starting = True  # until every rank has joined (a rank's death then may be a script's missing guard)
        for rank in range(1 if driver_rank else 0, world_size):
            self._spawn(ctx, rank, (world_size, store_path, backend, threads_per_rank, timeout_s), device,
                        driver_rank)
        if driver_rank:
            self._driver = DriverRank(store_path, world_size, threads_per_rank, timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="cpinfer-rank-watcher", daemon=True)
        self._watcher.start()
        try:
            self._book.expect(self._proc_of, START_UP, "start-up")
            self._collect("start-up", sorted(self._proc_of))
            if self._driver is not None:
                self._driver.wait_joined(self)
        except BaseException:
            self.close(force=True)
            raise
        self._starting = False

    def _spawn(self, ctx, rank: int, world: tuple, device: str, alarm: bool) -> None:
        """Start rank process `rank` with its pipes; world: (size, store path, backend, threads, timeout_s)."""
        in_recv, in_send = ctx.Pipe(duplex=False)  # driver -> rank
        out_recv, out_send = ctx.Pipe(duplex=False)  # rank -> driver
        alarm_recv, alarm_send = ctx.Pipe(duplex=False) if alarm else (None, None)
        size, store_path, backend, threads, timeout_s = world
        p = ctx.Process(target=worker_main, daemon=True,
                        args=(rank, size, store_path, backend, threads, timeout_s, in_recv, out_send, device,
                              alarm_send))
        p.start()
        in_recv.close()  # the rank's ends live in the rank: a dead rank then reads as EOF here
        out_send.close()
        if alarm_send is not None:
            alarm_send.close()
            self._alarms[rank] = alarm_recv
        self._inboxes[rank], self._outboxes[rank], self._proc_of[rank] = in_send, out_recv, p

    def _exited(self, rank: int) -> str:
        """Why rank process `rank` is gone (it has exited or is exiting) and what to do about it."""
        proc = self._proc_of[rank]
        proc.join(timeout=1)
        return rank_death(rank, proc.pid, proc.exitcode, self._starting)

    @property
    def driver_rank(self) -> bool:
        """Whether rank 0 is this process."""
        return self._driver is not None

    @property
    def _procs(self) -> list:
        """The rank processes (not rank 0 when it is this process)."""
        return list(self._proc_of.values())

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] * self.driver_rank + [p.pid for p in self._procs]

    def _watch(self) -> None:
        """Wake up as soon as any rank process ends (its sentinel); record why unless the pool is closing. With
        rank 0 here, a rank's alarm while rank 0 is inside a call starts the grace period after which the rank
        processes are killed (rank 0 may be waiting for the failed rank in a collective)."""
        sentinels = {p.sentinel: r for r, p in self._proc_of.items()}
        alarms = {conn: r for r, conn in self._alarms.items()}
        while not self._closing:
            ready = multiprocessing.connection.wait([*sentinels, *alarms], timeout=0.5)
            if not ready or self._closing:
                continue
            if ready[0] in alarms:
                rank = alarms[ready[0]]
                try:
                    call = int.from_bytes(ready[0].recv_bytes(), "little")  # the call in which it raised
                except (EOFError, OSError):  # that rank exited: its sentinel says so
                    del alarms[ready[0]]
                    continue
                deadline = time.monotonic() + self.fail_grace_s
                while self._driver_call == call and time.monotonic() < deadline and not self._closing:
                    time.sleep(0.01)
                if self._driver_call == call and not self._closing:  # rank 0 is stuck waiting for it
                    self._alarmed = rank
                    self.dead_reason = f"rank {rank} raised while rank 0 (this process) waited for it"
                    for p in self._procs:
                        p.kill()
                    return
                continue
            self.dead_reason = self._exited(sentinels[ready[0]])
            return

    def _collect(self, what: str, ranks: list[int]) -> list[Any]:
        """The replies of `ranks` to the calls they owe, in rank order (rank 0's is in when it ran here). Whatever
        happens, those calls end here: a reply still to come is dropped when it arrives."""
        try:
            self._await(what, ranks)
        finally:
            replies = self._book.take(ranks)
        errors = {r: payload for r, (status, payload) in replies.items() if status == "error"}
        if self._alarmed is not None:  # rank 0's error came from the processes killed under it: report theirs
            if len(errors) > 1:
                del errors[0]
            self.close(force=True)
            raise RemoteError(errors or {self._alarmed: ("RuntimeError", self.dead_reason, "")})
        if errors:
            raise RemoteError(errors)
        return [replies[r][1] for r in ranks]

    def _await(self, what: str, ranks: list[int]) -> None:
        """Read replies until every one of `ranks` has answered its call, or its pipe closed after the watcher killed
        it for another rank's error; else `_fail`, or `RemoteError` when ranks raised and the rest stay silent for
        `fail_grace_s`."""
        deadline = time.monotonic() + self.timeout_s + 30.0
        first_error, gone = None, set()
        while True:
            errors = self._book.errors(ranks)
            if errors and first_error is None:
                first_error = time.monotonic()
            pending = [r for r in ranks if r not in self._book.replies and r not in gone]
            if not pending:
                return
            ready = self._ready(pending, 0.1)
            for r in ready:
                if self._read_reply(r):
                    continue
                if self._alarmed is not None and errors:  # killed by the watcher after its error (read)
                    gone.add(r)
                    continue
                self.dead_reason = self.dead_reason or self._exited(r)  # the rank exited: the watcher names how
                self._fail(what)
            if ready:
                continue
            now = time.monotonic()
            if self.dead_reason is not None or now > deadline:
                self._fail(what)
            if first_error is not None and now - first_error > self.fail_grace_s:
                self.close(force=True)  # the silent ranks wait in a collective for the failed one: end them
                self.dead_reason = (f"rank {min(errors)} raised during {what} while rank(s) {pending} were still "
                                    "inside it")
                raise RemoteError(errors)

    def _ready(self, ranks: list[int], timeout_s: float) -> list[int]:
        """The ranks among these whose pipe has a message (or closed), after waiting up to timeout_s."""
        if len(ranks) == 1:  # one poll syscall (a decode step of a local request waits on one rank)
            return ranks if self._outboxes[ranks[0]].poll(timeout_s) else []
        rank_of = {self._outboxes[r]: r for r in ranks}
        return [rank_of[c] for c in multiprocessing.connection.wait(list(rank_of), timeout=timeout_s)]

    def _read_reply(self, rank: int) -> bool:
        """File one reply of rank process `rank` (dropped if stale); False when its pipe closed (it exited)."""
        try:
            call, sender, status, payload = self._outboxes[rank].recv()
        except (EOFError, OSError):
            return False
        self._book.file(call, sender, status, payload)
        return True

    def _fail(self, what: str) -> None:
        self.close(force=True)
        why = self.dead_reason or f"no answer in time ({self.timeout_s:g} s + 30 s)"
        raise RuntimeError(f"worker pool failed during {what}: {why}; the pool was shut down")

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        """Call `fn(ctx, *args, **kwargs)` on every rank; results in rank order."""
        return self.run_each(fn, [args] * self.world_size, kwargs)

    def run_each(self, fn: Callable, args_per_rank: list[tuple], kwargs: dict | None = None) -> list[Any]:
        """Like `run`, with a different argument tuple for each rank."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples, got {len(args_per_rank)}")
        return self.run_some(fn, args_per_rank, kwargs)

    def run_some(self, fn: Callable, args_per_rank: list[tuple | None], kwargs: dict | None = None) -> list[Any]:
        """Like `run_each`; a rank whose entry is None is not called at all (its result is None)."""
        what = getattr(fn, "__name__", "call")
        self._check_open(what)
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples (or None), got {len(args_per_rank)}")
        called = [r for r, args in enumerate(args_per_rank) if args is not None]
        call = self._book.open(called, what)
        here = self._driver is not None and args_per_rank[0] is not None
        # the watcher's cue that rank 0 is in this call, set before any rank process can fail in it
        self._driver_call = call if here else 0
        try:
            self._send(call, fn, {r: args_per_rank[r] for r in called if r in self._proc_of}, kwargs, what)
            if here:
                self._run_here(call, fn, args_per_rank[0], kwargs)
        finally:
            self._driver_call = 0
        answers = dict(zip(called, self._collect(what, called)))
        return [answers.get(r) for r in range(self.world_size)]

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError("worker pool is closed" + (f": {self.dead_reason}" if self.dead_reason else ""))
        if self.dead_reason is not None:
            self._fail(what)

    def _send(self, call: int, fn: Callable, args_per_rank: dict[int, tuple], kwargs: dict | None,
              what: str) -> None:
        """Call `call` of `fn` to these rank processes: (fn, args, kwargs, call id) down each one's pipe."""
        for r, args in args_per_rank.items():
            try:
                self._inboxes[r].send((fn, tuple(args), kwargs or {}, call))
            except (BrokenPipeError, EOFError, OSError):  # the rank is gone
                self.dead_reason = self.dead_reason or self._exited(r)
                self._fail(what)

    def _run_here(self, call: int, fn: Callable, args: tuple, kwargs: dict | None) -> None:
        """Rank 0's share of call `call`, in this thread; its reply is filed as a rank process's would be."""
        try:
            reply = ("ok", fn(self._driver.ctx, *args, **(kwargs or {})))
        except Exception as exc:  # noqa: BLE001 - the same shape as a rank process's error
            reply = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
        except BaseException:  # Ctrl-C here: the ranks may wait for rank 0 in a collective
            self.close(force=True)
            raise
        self._book.file(call, 0, *reply)

    def submit_some(self, fn: Callable, args_per_rank: dict[int, tuple]) -> list[int]:
        """Send `fn(ctx, *args)` to the rank processes named in `args_per_rank` and return at once, without waiting
        for them: groups of ranks with calls in flight side by side (prefill and decode groups). The caller
        collects each submission with `collect_some(ranks)`, or gives it up with `abandon(ranks)`, and sends those
        ranks nothing else meanwhile. Needs every named rank to be a process (not rank 0 in this process)."""
        what = getattr(fn, "__name__", "call")
        self._check_open(what)
        ranks = sorted(args_per_rank)
        if any(r not in self._proc_of for r in ranks):
            raise ValueError(f"submit_some needs rank processes, got ranks {ranks} (rank 0 runs here)")
        self._send(self._book.open(ranks, what), fn, {r: args_per_rank[r] for r in ranks}, None, what)
        return ranks

    def answered(self, ranks: list[int]) -> bool:
        """Whether every one of these ranks has answered its submitted call (`collect_some` will not wait)."""
        for r in ranks:
            while r not in self._book.replies and self._outboxes[r].poll(0):
                if not self._read_reply(r):  # the rank exited: collecting says how
                    return True
        return self._book.has(ranks)

    def wait_any(self, ranks: list[int], timeout_s: float) -> None:
        """Block until one of these ranks answers (or a rank dies, or timeout_s passes); stale replies that come
        in meanwhile are dropped."""
        deadline = time.monotonic() + timeout_s
        while self.dead_reason is None and ranks and not any(r in self._book.replies for r in ranks):
            ready = self._ready(ranks, max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            for r in ready:
                if not self._read_reply(r):  # the rank exited: the watcher names how
                    return

    def collect_some(self, ranks: list[int], what: str = "call") -> list[Any]:
        """The answers of a `submit_some` call's ranks, in rank order (waits for them; errors as `run`'s)."""
        return self._collect(what, ranks)

    def abandon(self, ranks: list[int]) -> None:
        """Give up the calls in flight on these ranks without collecting them (an engine closing with a call in
        flight): their replies are dropped when they come; the ranks take new calls after finishing those."""
        self._book.take(ranks)

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = self._closing = True
        if not force:
            for inbox in self._inboxes.values():
                try:
                    inbox.send(None)
                except OSError:  # that rank is gone already
                    pass
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in [*self._inboxes.values(), *self._outboxes.values(), *self._alarms.values()]:
            conn.close()
        if self._driver is not None:
            self._driver.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        _POOLS["open"].discard(id(self))
        if not _POOLS["open"] and _POOLS["tracker"]:  # the last pool: no helper process outlives the ranks
            _POOLS["tracker"] = False
            _stop_tracker()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)

    def __del__(self):
        try:
            self.close(force=True)
        except Exception:  # noqa: BLE001
            pass
