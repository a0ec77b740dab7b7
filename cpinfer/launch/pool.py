"""Local process launcher: start N ranks once, then run many functions on all of them (SPMD).

Used by tests, benchmarks and the local `LLM(...)` launcher. Each rank joins one gloo (CPU) or NCCL (GPU)
world; a function sent with `run` is called as `fn(ctx, *args)` on every rank and its per-rank results come
back in rank order. Local ranks rendezvous through a private FileStore and bind their sockets to loopback only.
A rank that dies is seen at once by a watcher on the process sentinels (`dead_reason`), even between calls; a
call in which one rank raised while the others are still inside it (stuck in a collective) kills the pool within
`fail_grace_s` instead of waiting for the collective timeout.

With `driver_rank=True` (gloo on CPU) rank 0 is this process: a call on it runs right here, without the pickle,
pipe and process wake-ups of a round trip to a rank process (about half a millisecond, a large share of a short
decode step). Rank 0 then holds torch's default process group, so one such pool at a time per process
(`driver_can_host_rank`).
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import pickle
import queue
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
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


def loopback_interface() -> str | None:
    """Name of the loopback network interface ("lo" on Linux), or None when it cannot be found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def _bind_to_loopback() -> None:
    """Gloo and NCCL sockets of local ranks listen on loopback only (a user's choice in the environment wins)."""
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _set_parent_death_signal() -> None:
    """Ask Linux to kill this rank if the driver dies, so no orphan ranks are left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: rely on daemon processes
        pass


def leave_shutdown_to_driver() -> None:
    """A rank ignores SIGINT and SIGTERM: Ctrl-C, systemd's stop (SIGTERM to the whole control group) and torchrun's
    agent signal every process, and the driver then finishes in-flight requests and stops the ranks itself (a rank
    whose driver dies is killed by the parent-death signal, or its world's connections close)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _worker_main(rank, world_size, store_path, backend, threads, timeout_s, inbox, outbox, device_type="cpu",
                 alarm=None):
    _set_parent_death_signal()
    leave_shutdown_to_driver()
    os.environ["RANK"] = str(rank)
    _bind_to_loopback()
    if threads:
        torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if device_type == "cuda":  # one GPU per rank (the pool checked there are enough), or shared over gloo
        device = gpu_of_rank(rank)
        torch.cuda.set_device(device)
    try:
        store = dist.FileStore(store_path, world_size)  # a file, not a TCP store listening on every interface
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        group = dist.group.WORLD
        cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        ctx = RankContext(rank, world_size, group, cpu_group, device, {})
        outbox.send((rank, "ready", None))
    except Exception as exc:  # noqa: BLE001 - report start-up failure to the driver
        outbox.send((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the driver is gone
            break
        if msg is None:
            break
        fn, args, kwargs, call = msg
        try:
            result = fn(ctx, *args, **kwargs)
            outbox.send((rank, "ok", result))  # pickled here: an unpicklable result is this call's error
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            outbox.send((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
            if alarm is not None:  # the driver may be inside this call as rank 0: its watcher reads this at once
                alarm.send_bytes(call.to_bytes(8, "little"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    _exit_rank()


def _exit_rank() -> None:
    """End a rank process that has left its group, at once: the interpreter's teardown and the C++ libraries' exit
    work after it (gloo's, the thread pools') take 1-5 s per pool on a busy CPU, and now and then hang until the
    pool's close kills the rank. The rank holds nothing that needs them: its output is flushed here, and the driver
    waits for the KV tiers' disk writes before it closes the pool."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to write
            pass
    os._exit(0)


_DRIVER_HOSTS = threading.Lock()  # held while a pool's rank 0 lives in this process (torch's default group)
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


def driver_can_host_rank() -> bool:
    """True when this process may be rank 0 of a new local pool: it holds no process group of its own (torch
    allows one default group per process) and no other pool's rank 0."""
    return not dist.is_initialized() and not _DRIVER_HOSTS.locked()


class WorkerPool:
    """N local ranks started once. `run(fn, *args)` calls `fn(ctx, *args)` on every rank and returns the results.

    `fn` must be importable by name (a module-level function). `timeout_s` bounds both the collectives inside
    the ranks and how long the driver waits for a call, so a stuck rank fails the call instead of hanging
    forever; a rank that exits fails the call (and sets `dead_reason`) at once, and when some ranks raised while
    the others have not answered `fail_grace_s` later, those are stuck waiting for them: the pool is killed.

    `driver_rank=True` (gloo on CPU only) makes this process rank 0: its share of a call runs in the calling
    thread, and a call only on rank 0 needs no message at all. A rank process that raises while rank 0 waits for
    it in a collective rings an alarm: the watcher kills the rank processes after `fail_grace_s`, which ends rank
    0's collective at once (gloo sees the closed connections), and the call raises the rank's own error.
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
        if driver_rank and not (_DRIVER_HOSTS.acquire(blocking=False)):
            raise RuntimeError("this process already hosts rank 0 of another worker pool (close it first)")
        if driver_rank and dist.is_initialized():
            _DRIVER_HOSTS.release()
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
        self._driver: _DriverRank | None = None  # rank 0, when it is this process
        self._driver_call = 0  # driver_rank: the number of the call rank 0 is in, from its first send (0: none)
        self._calls = 0  # calls sent so far (numbers them from 1)
        self._alarmed: int | None = None  # the rank whose error made the watcher end the pool
        first = 1 if driver_rank else 0
        for rank in range(first, world_size):
            in_recv, in_send = ctx.Pipe(duplex=False)  # driver -> rank
            out_recv, out_send = ctx.Pipe(duplex=False)  # rank -> driver
            alarm_recv, alarm_send = ctx.Pipe(duplex=False) if driver_rank else (None, None)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, store_path, backend, threads_per_rank, timeout_s, in_recv, out_send,
                      device, alarm_send),
                daemon=True,
            )
            p.start()
            in_recv.close()  # the rank's ends live in the rank: a dead rank then reads as EOF here
            out_send.close()
            if alarm_send is not None:
                alarm_send.close()
                self._alarms[rank] = alarm_recv
            self._inboxes[rank], self._outboxes[rank], self._proc_of[rank] = in_send, out_recv, p
        if driver_rank:
            self._driver = _DriverRank(store_path, world_size, threads_per_rank, timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="cpinfer-rank-watcher", daemon=True)
        self._watcher.start()
        try:
            self._collect(what="start-up")
            if self._driver is not None:
                self._driver.wait_joined(self)
        except BaseException:
            self.close(force=True)
            raise

    def _exited(self, rank: int) -> str:
        """Why rank process `rank` is gone (it has exited or is exiting)."""
        self._proc_of[rank].join(timeout=1)
        return f"rank {rank} exited ({describe_exit(self._proc_of[rank].exitcode)})"

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

    def _collect(self, what: str, ranks: list[int] | None = None, mine: tuple | None = None) -> list[Any]:
        """The answers of `ranks` (default: all rank processes) to the call just sent, in rank order; `mine` is
        rank 0's (status, payload) when it ran here."""
        pending = {self._outboxes[r]: r for r in (self._proc_of if ranks is None else ranks)}
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        deadline = time.monotonic() + self.timeout_s + 30.0
        first_error = None
        if mine is not None:
            if mine[0] == "error":
                errors[0] = mine[1]
                first_error = time.monotonic()
            else:
                results[0] = mine[1]
        while pending:
            if len(pending) == 1:  # one poll syscall (a decode step of a local request waits on one rank)
                conn = next(iter(pending))
                ready = [conn] if conn.poll(0.1) else []
            else:
                ready = multiprocessing.connection.wait(list(pending), timeout=0.1)
            for conn in ready:
                r = pending.pop(conn)
                try:
                    rank, status, payload = conn.recv()
                except (EOFError, OSError):  # the rank exited: the watcher names how
                    if self._alarmed is not None and errors:  # killed by the watcher after its error (read)
                        continue
                    self.dead_reason = self.dead_reason or self._exited(r)
                    self._fail(what)
                if status == "error":
                    errors[rank] = payload
                    first_error = first_error or time.monotonic()
                else:
                    results[rank] = payload
            if ready or not pending:
                continue
            now = time.monotonic()
            if self.dead_reason is not None or now > deadline:
                self._fail(what)
            if first_error is not None and now - first_error > self.fail_grace_s:
                self.close(force=True)  # the silent ranks wait in a collective for the failed one: end them
                self.dead_reason = (f"rank {min(errors)} raised during {what} while rank(s) "
                                    f"{sorted(pending.values())} were still inside it")
                raise RemoteError(errors)
        if self._alarmed is not None:  # rank 0's error came from the processes killed under it: report theirs
            if len(errors) > 1:
                del errors[0]
            self.close(force=True)
            raise RemoteError(errors or {self._alarmed: ("RuntimeError", self.dead_reason, "")})
        if errors:
            raise RemoteError(errors)
        return [results[r] for r in sorted(results)]

    def _fail(self, what: str) -> None:
        self.close(force=True)
        why = (f"{self.dead_reason} (see its output above; a script that starts ranks needs an "
               "`if __name__ == \"__main__\":` guard)") if self.dead_reason else "no answer in time"
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
        if self._closed:
            raise RuntimeError("worker pool is closed" + (f": {self.dead_reason}" if self.dead_reason else ""))
        if self.dead_reason is not None:
            self._fail(getattr(fn, "__name__", "call"))
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples (or None), got {len(args_per_rank)}")
        called = [r for r, args in enumerate(args_per_rank) if args is not None]
        remote = [r for r in called if r in self._proc_of]
        what = getattr(fn, "__name__", "call")
        self._calls += 1
        here = self._driver is not None and args_per_rank[0] is not None
        # the watcher's cue that rank 0 is in this call, set before any rank process can fail in it
        self._driver_call = self._calls if here else 0
        mine = None
        try:
            for r in remote:
                try:
                    self._inboxes[r].send((fn, tuple(args_per_rank[r]), kwargs or {}, self._calls))
                except (BrokenPipeError, EOFError, OSError):  # the rank is gone
                    self.dead_reason = self.dead_reason or self._exited(r)
                    self._fail(what)
            if here:
                try:
                    mine = ("ok", fn(self._driver.ctx, *args_per_rank[0], **(kwargs or {})))
                except Exception as exc:  # noqa: BLE001 - the same shape as a rank process's error
                    mine = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
                except BaseException:  # Ctrl-C here: the ranks may wait for rank 0 in a collective
                    self.close(force=True)
                    raise
        finally:
            self._driver_call = 0
        answers = dict(zip([0] * (mine is not None) + remote, self._collect(what, remote, mine)))
        return [answers.get(r) for r in range(self.world_size)]

    def submit_some(self, fn: Callable, args_per_rank: dict[int, tuple]) -> list[int]:
        """Send `fn(ctx, *args)` to the rank processes named in `args_per_rank` and return at once, without waiting
        for them: groups of ranks with calls in flight side by side (prefill and decode groups). The caller
        collects each submission with `collect_some(ranks)` and sends those ranks nothing else meanwhile. Needs
        every named rank to be a process (not rank 0 in this process)."""
        if self._closed:
            raise RuntimeError("worker pool is closed" + (f": {self.dead_reason}" if self.dead_reason else ""))
        what = getattr(fn, "__name__", "call")
        if self.dead_reason is not None:
            self._fail(what)
        ranks = sorted(args_per_rank)
        if any(r not in self._proc_of for r in ranks):
            raise ValueError(f"submit_some needs rank processes, got ranks {ranks} (rank 0 runs here)")
        self._calls += 1
        for r in ranks:
            try:
                self._inboxes[r].send((fn, tuple(args_per_rank[r]), {}, self._calls))
            except (BrokenPipeError, EOFError, OSError):  # the rank is gone
                self.dead_reason = self.dead_reason or self._exited(r)
                self._fail(what)
        return ranks

    def answered(self, ranks: list[int]) -> bool:
        """Whether every one of these ranks has answered its submitted call (`collect_some` will not wait)."""
        return all(self._outboxes[r].poll(0) for r in ranks)

    def wait_any(self, ranks: list[int], timeout_s: float) -> None:
        """Block until one of these ranks answers (or a rank dies, or timeout_s passes)."""
        if self.dead_reason is None and ranks:
            multiprocessing.connection.wait([self._outboxes[r] for r in ranks], timeout=timeout_s)

    def collect_some(self, ranks: list[int], what: str = "call") -> list[Any]:
        """The answers of a `submit_some` call's ranks, in rank order (waits for them; errors as `run`'s)."""
        return self._collect(what, ranks)

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


class _DriverRank:
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
        _bind_to_loopback()
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

    def wait_joined(self, pool: WorkerPool) -> None:
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
        _DRIVER_HOSTS.release()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._joined.is_set():  # else the joiner leaves when its wait ends
                self._leave()


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


def joined_world_requested() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _call(fn, ctx, args, kwargs):
    try:
        return ("ok", fn(ctx, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to rank 0
        return ("error", (type(exc).__name__, str(exc), traceback.format_exc()))


def heartbeat(ctx) -> int:
    """A no-op every rank answers: the driver's idle check that a joined world's ranks are still there."""
    return ctx.rank


def _send_frame(sock: socket.socket, obj: Any) -> None:
    """One control message: its length (8 bytes) then its pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = len(data).to_bytes(8, "little")
    if len(data) < (1 << 16):  # one segment for a decode step's small message
        sock.sendall(head + data)
    else:  # a large one without the copy
        sock.sendall(head)
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the control connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> Any:
    return pickle.loads(_recv_exact(sock, int.from_bytes(_recv_exact(sock, 8), "little")))


def _tune(sock: socket.socket) -> None:
    """No Nagle delay on a decode step's small messages; on an idle connection, keep-alive probes find a peer whose
    machine vanished without closing it (within about 20 s where the platform lets us set the intervals)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def source_address_toward(host: str) -> str:
    """This machine's IPv4 address on the route to `host` (OSError when there is none). No packet is sent:
    connecting a UDP socket only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def control_address() -> str:
    """The IPv4 address rank 0 listens on for its ranks' control connections: the one this machine reaches
    MASTER_ADDR through (loopback for a one-machine world; node 0's own address when MASTER_ADDR is node 0)."""
    try:
        return source_address_toward(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    except OSError:
        return "127.0.0.1"


class _RankLinks:
    """Rank 0's side of a subset-mode joined world: one TCP connection per other rank (pickled messages, length
    first), a reader thread that files each rank's answer as it arrives and notices a closed connection at once,
    and a worker thread that runs rank 0's own share of each call (so the driver thread stays free to submit and
    collect other groups' calls while rank 0 is inside a long one).

    The worker thread alone uses this process's data groups (world, roles) once the world is up; the driver thread
    alone uses the control group (at start-up), so no process group is ever used by two threads at once."""

    def __init__(self, world: "JoinedWorld", listen: socket.socket, token: bytes, timeout_s: float):
        self.world = world
        self.socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        listen.settimeout(1.0)
        try:
            while len(self.socks) < world.world_size - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, world.world_size)) - set(self.socks))
                    raise RuntimeError(f"rank(s) {missing} did not open their control connection to rank 0 within "
                                       f"{timeout_s:.0f} s")
                try:
                    conn, _ = listen.accept()
                except socket.timeout:
                    continue
                conn.settimeout(10.0)
                try:
                    hello = _recv_exact(conn, 8 + len(token))
                except (OSError, ConnectionError):
                    conn.close()
                    continue
                rank = int.from_bytes(hello[:8], "little")
                if hello[8:] != token or not 0 < rank < world.world_size or rank in self.socks:
                    conn.close()  # not one of this world's ranks
                    continue
                conn.settimeout(None)
                _tune(conn)
                self.socks[rank] = conn
        except BaseException:
            for s in self.socks.values():
                s.close()
            raise
        finally:
            listen.close()
        self.answers: dict[int, tuple] = {}  # rank → (status, payload) of its call in flight
        self.cond = threading.Condition()
        self._buffers = {r: bytearray() for r in self.socks}
        self._wake_r, self._wake_w = os.pipe()  # close() ends the reader's select
        self._stop = False
        self._threads = torch.get_num_threads()
        self.inbox: Any = queue.SimpleQueue()  # rank 0's calls: (fn, args, kwargs) or None to stop
        self.reader = threading.Thread(target=self._read, name="cpinfer-control-reader", daemon=True)
        self.worker = threading.Thread(target=self._work, name="cpinfer-rank0-worker", daemon=True)
        self.reader.start()
        self.worker.start()

    def _file(self, rank: int, answer: tuple) -> None:
        with self.cond:
            if answer[0] == "error" and self.world.dead_reason is None:  # the rank exits (rank 0: stops driving)
                self.world.dead_reason = f"rank {rank} raised {answer[1][0]}: {answer[1][1]}"
            self.answers[rank] = answer
            self.cond.notify_all()

    def _lost(self, rank: int, why: str) -> None:
        with self.cond:
            if self.world.dead_reason is None:
                self.world.dead_reason = f"rank {rank} is gone ({why})"
            self.cond.notify_all()

    def _read(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for r, sock in self.socks.items():
            sel.register(sock, selectors.EVENT_READ, r)
        left = len(self.socks)
        try:
            while not self._stop and left:
                for key, _ in sel.select(5.0):
                    rank = key.data
                    if rank is None or self._stop:  # close() woke us
                        return
                    try:
                        chunk = key.fileobj.recv(1 << 20)
                    except OSError as exc:
                        chunk, why = b"", f"its control connection failed: {exc}"
                    else:
                        why = "its control connection closed: the process exited"
                    if not chunk:
                        sel.unregister(key.fileobj)
                        left -= 1
                        self._lost(rank, why)
                        continue
                    buf = self._buffers[rank]
                    buf += chunk
                    while len(buf) >= 8 and len(buf) >= 8 + int.from_bytes(buf[:8], "little"):
                        n = int.from_bytes(buf[:8], "little")
                        answer = pickle.loads(bytes(buf[8:8 + n]))
                        del buf[:8 + n]
                        self._file(rank, answer)
        finally:
            sel.close()

    def _work(self) -> None:
        torch.set_num_threads(self._threads)  # the rank's threads, in this thread too
        if self.world.ctx.device.type == "cuda":  # the current GPU is a per-thread setting
            torch.cuda.set_device(self.world.ctx.device)
        while True:
            item = self.inbox.get()
            if item is None:
                return
            fn, args, kwargs = item
            self._file(0, _call(fn, self.world.ctx, args, kwargs))  # an error: peers may wait for rank 0 in a
            # collective, the world is unusable now

    def send(self, rank: int, msg: Any) -> None:
        if rank == 0:
            self.inbox.put(msg)
        else:
            _send_frame(self.socks[rank], msg)

    def close(self, wait_s: float) -> bool:
        """Stop the threads and close the connections; True when rank 0's worker has left (it may be stuck in a
        collective with a dead peer: it is a daemon thread then, and the process may not tear its groups down)."""
        self._stop = True
        self.inbox.put(None)
        os.write(self._wake_w, b"x")
        self.worker.join(wait_s)
        self.reader.join(1.0)
        for s in self.socks.values():
            try:
                s.close()
            except OSError:
                pass
        os.close(self._wake_r)
        os.close(self._wake_w)
        return not self.worker.is_alive()


class JoinedWorld:
    """The same `run` interface as `WorkerPool`, over an existing torchrun world: rank 0 drives, the others serve.

    Broadcast mode (the default; one CP group): rank 0 broadcasts each call over a gloo control group, runs it
    itself, and gathers every rank's result. The control group waits without a deadline-driven failure for idle
    periods (up to `idle_timeout_s`); the data groups keep `timeout_s`, and torchrun tears the job down if any rank
    dies. A rank that raises inside a call exits at once (rank 0: stops driving), so its peers' collectives fail on
    the closed connection instead of waiting for the timeout; `heartbeat` lets an idle driver notice a rank whose
    process is gone.

    Subset mode (`subsets=True`, chosen at construction on every rank; prefill / decode groups): calls go to any
    subset of the ranks, and calls of disjoint subsets are in flight side by side (`submit_some`, `answered`,
    `wait_any`, `collect_some`, as `WorkerPool`'s). Each rank holds a TCP connection to rank 0 (its address goes
    out over the control group at start-up, with a token every rank must present); messages are pickles, length
    first. Rank 0's own share runs on a worker thread fed by a queue; a reader thread files answers as they come
    and sets `dead_reason` the moment a rank's connection closes (its process exited), so a dead peer is seen in
    seconds, between calls too.
    """

    def __init__(self, backend: str = "gloo", threads_per_rank: int | None = None, timeout_s: float = 300.0,
                 idle_timeout_s: float = 7 * 24 * 3600.0, device: str | None = None, subsets: bool = False,
                 fail_grace_s: float = 2.0):
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
        self.timeout_s, self.fail_grace_s = timeout_s, fail_grace_s
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))
        cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        self.ctx = RankContext(self.rank, self.world_size, dist.group.WORLD, cpu_group, device, {})
        self.dead_reason: str | None = None
        self._closed = False
        self.subsets = subsets
        self._links: _RankLinks | None = None  # subset mode, rank 0
        self._link: socket.socket | None = None  # subset mode, other ranks: the connection to rank 0
        if subsets:
            self._open_links(timeout_s)

    def _open_links(self, timeout_s: float) -> None:
        """Subset mode: rank 0 listens on `control_address()` (an ephemeral port), tells every rank where over the
        control group, and accepts one connection per rank."""
        listen, token = None, None
        if self.rank == 0:
            host = control_address()
            listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listen.bind((host, 0))
                listen.listen(self.world_size)
            except OSError:
                listen.close()
                raise
            token = os.urandom(16)
            msg = [(host, listen.getsockname()[1], token)]
        else:
            msg = [None]
        dist.broadcast_object_list(msg, src=0, group=self._control)
        if self.rank == 0:  # every rank connects right after the broadcast: a missing one has failed
            self._links = _RankLinks(self, listen, token, min(timeout_s, 120.0))
            return
        host, port, token = msg[0]
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.settimeout(None)
        _tune(sock)
        sock.sendall(self.rank.to_bytes(8, "little") + token)
        self._link = sock

    # ------------------------------------------------------------------ rank 0: calls
    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        if self.rank != 0:
            raise RuntimeError("only rank 0 drives a joined world")
        if self.dead_reason is not None:
            raise RuntimeError(f"the joined world is unusable: {self.dead_reason}")
        if self.subsets:
            return self.run_some(fn, [args] * self.world_size, kwargs)
        msg = [(fn, args, kwargs)]
        try:
            dist.broadcast_object_list(msg, src=0, group=self._control)
        except Exception as exc:  # a peer's connection closed: its process is gone
            self.dead_reason = f"a rank is unreachable ({type(exc).__name__})"
            raise
        mine = _call(fn, self.ctx, args, kwargs)
        if mine[0] == "error" and fn is not heartbeat:  # peers may wait in a collective for us: do not gather
            self.dead_reason = f"rank 0 raised {mine[1][0]} during {getattr(fn, '__name__', 'a call')}"
            raise RemoteError({0: mine[1]})
        try:
            return self._finish(mine)
        except RemoteError:
            raise
        except Exception as exc:
            self.dead_reason = f"a rank is unreachable ({type(exc).__name__})"
            raise

    def run_each(self, fn: Callable, args_per_rank: list[tuple], kwargs: dict | None = None) -> list[Any]:
        """Subset mode: a different argument tuple for each rank."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples, got {len(args_per_rank)}")
        return self.run_some(fn, args_per_rank, kwargs)

    def run_some(self, fn: Callable, args_per_rank: list[tuple | None], kwargs: dict | None = None) -> list[Any]:
        """Subset mode: call `fn` on the ranks whose entry is not None and wait for them (None for the others)."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples (or None), got {len(args_per_rank)}")
        called = {r: a for r, a in enumerate(args_per_rank) if a is not None}
        ranks = self.submit_some(fn, called, kwargs)
        answers = dict(zip(ranks, self.collect_some(ranks, getattr(fn, "__name__", "call"))))
        return [answers.get(r) for r in range(self.world_size)]

    def submit_some(self, fn: Callable, args_per_rank: dict[int, tuple], kwargs: dict | None = None) -> list[int]:
        """Subset mode: send `fn(ctx, *args)` to the named ranks (rank 0's share to its worker thread) and return
        at once; collect with `collect_some(ranks)`, sending those ranks nothing else meanwhile."""
        self._check_driving()
        ranks = sorted(args_per_rank)
        if any(not 0 <= r < self.world_size for r in ranks):
            raise ValueError(f"ranks {ranks} are not all in [0, {self.world_size})")
        links = self._links
        with links.cond:
            busy = [r for r in ranks if r in links.answers]
        if busy:
            raise RuntimeError(f"rank(s) {busy} still hold an answer nobody collected (a bug in the caller)")
        for r in ranks:
            try:
                links.send(r, (fn, tuple(args_per_rank[r]), kwargs or {}))
            except OSError as exc:
                links._lost(r, f"its control connection failed: {exc}")
                raise RuntimeError(f"the joined world failed during {getattr(fn, '__name__', 'call')}: "
                                   f"{self.dead_reason}") from exc
        return ranks

    def answered(self, ranks: list[int]) -> bool:
        """Whether every one of these ranks has answered its submitted call (`collect_some` will not wait)."""
        links = self._links
        with links.cond:
            return all(r in links.answers for r in ranks)

    def wait_any(self, ranks: list[int], timeout_s: float) -> None:
        """Block until one of these ranks answers (or a rank is gone, or timeout_s passes)."""
        links = self._links
        with links.cond:
            links.cond.wait_for(lambda: self.dead_reason is not None or any(r in links.answers for r in ranks),
                                timeout_s)

    def collect_some(self, ranks: list[int], what: str = "call") -> list[Any]:
        """The answers of a `submit_some` call's ranks, in rank order. Raises `RemoteError` when ranks raised (after
        `fail_grace_s` for the others, which may be stuck in a collective with them), RuntimeError when a rank is
        gone or none answered within the timeout."""
        links = self._links
        deadline = time.monotonic() + self.timeout_s + 30.0
        first_error = None
        with links.cond:
            while True:
                got = {r: links.answers[r] for r in ranks if r in links.answers}
                errors = {r: payload for r, (status, payload) in got.items() if status == "error"}
                if len(got) == len(ranks) or (errors and first_error is not None
                                              and time.monotonic() - first_error > self.fail_grace_s):
                    break
                if errors and first_error is None:
                    first_error = time.monotonic()
                if self.dead_reason is not None and not errors:
                    self._closed_answers(ranks)
                    raise RuntimeError(f"the joined world failed during {what}: {self.dead_reason}")
                if time.monotonic() > deadline:
                    self.dead_reason = self.dead_reason or f"no answer to {what} within {self.timeout_s + 30:.0f} s"
                    raise RuntimeError(f"the joined world failed during {what}: {self.dead_reason}")
                links.cond.wait(0.1 if first_error is not None or self.dead_reason is not None else 1.0)
            self._closed_answers(ranks)
        if errors:
            raise RemoteError(errors)
        return [got[r][1] for r in ranks]

    def _closed_answers(self, ranks: list[int]) -> None:
        for r in ranks:
            self._links.answers.pop(r, None)

    def _check_driving(self) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 drives a joined world")
        if not self.subsets:
            raise RuntimeError("this joined world broadcasts every call to every rank: calls on a subset of the "
                               "ranks need JoinedWorld(subsets=True) on every rank")
        if self._closed:
            raise RuntimeError("the joined world is closed" + (f": {self.dead_reason}" if self.dead_reason else ""))
        if self.dead_reason is not None:
            raise RuntimeError(f"the joined world is unusable: {self.dead_reason}")

    def heartbeat(self) -> None:
        """Every rank answers a no-op (raises when one is gone and its connection closed); in subset mode the reader
        thread sees a closed connection by itself, so this only reports it."""
        if self.subsets:
            if self.dead_reason is not None:
                raise RuntimeError(f"the joined world is unusable: {self.dead_reason}")
            return
        self.run(heartbeat)

    def _finish(self, mine) -> list[Any]:
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._control)
        if self.rank != 0:
            return []
        errors = {r: payload for r, (status, payload) in enumerate(gathered) if status == "error"}
        if errors:
            raise RemoteError(errors)
        return [payload for _, payload in gathered]

    # ------------------------------------------------------------------ the other ranks
    def serve_forever(self) -> None:
        """Ranks other than 0: run calls from rank 0 until it shuts down, then exit the process."""
        leave_shutdown_to_driver()
        while True:
            if self.subsets:
                try:
                    msg = _recv_frame(self._link)
                except (OSError, ConnectionError) as exc:
                    raise RuntimeError(f"rank {self.rank}: the driver (rank 0) is gone: {exc}") from None
                if msg is None:
                    break
            else:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=self._control)
                if box[0] is None:
                    break
                msg = box[0]
            fn, args, kwargs = msg
            mine = _call(fn, self.ctx, args, kwargs)
            if self.subsets:  # an error too: rank 0 reports it before it sees the connection close
                try:
                    _send_frame(self._link, mine)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an unpicklable result: an error
                    mine = ("error", (type(exc).__name__, f"the result of {fn.__name__} cannot be sent: {exc}",
                                      traceback.format_exc()))
                    _send_frame(self._link, mine)
            if mine[0] == "error":  # exit now: peers stuck in a collective with us fail at once, torchrun ends the job
                print(f"rank {self.rank}: {fn.__name__} raised {mine[1][0]}: {mine[1][1]}\n{mine[1][2]}",
                      file=sys.stderr, flush=True)
                os._exit(1)
            if not self.subsets:
                self._finish(mine)
        if self._link is not None:
            self._link.close()
        dist.destroy_process_group()
        raise SystemExit(0)

    def close(self, force: bool = False) -> None:
        if self._closed or self.rank != 0:
            return
        self._closed = True
        if self._links is not None:
            for r in self._links.socks:  # ranks inside a call read it when they are done (it waits in the socket)
                try:
                    _send_frame(self._links.socks[r], None)
                except OSError:  # that rank is gone
                    pass
            left = self._links.close(wait_s=1.0 if force or self.dead_reason is not None else self.timeout_s)
            if left:
                dist.destroy_process_group()
            return
        if self.dead_reason is None:  # with a peer gone, the broadcast could wait for ever: the job ends with us
            dist.broadcast_object_list([None], src=0, group=self._control)
        dist.destroy_process_group()
