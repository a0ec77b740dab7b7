"""`JoinedWorld`: the pool interface over a world something else started (torchrun, or `--nnodes`): rank 0
drives, the other ranks serve its calls, broadcast to all over a gloo group or, in subset mode, sent to any subset
over the TCP control channel (`control.py`)."""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from cpinfer.device import check_gpus, gpu_of_rank
from cpinfer.launch.calls import CallBook
from cpinfer.launch.common import RankContext, RemoteError, heartbeat, run_call
from cpinfer.launch.control import RankLinks, control_address, recv_frame, send_frame, tune
from cpinfer.launch.rank import exit_after_error, leave_shutdown_to_driver


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
    seconds, between calls too. In both modes a call carries an id and each reply the id it answers (`CallBook`).
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
        self._book = CallBook()  # rank 0: the calls in flight (subset mode: its links' reader files the replies)
        self.subsets = subsets
        self._links: RankLinks | None = None  # subset mode, rank 0
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
            self._links = RankLinks(self, listen, token, min(timeout_s, 120.0), self._book)
            return
        host, port, token = msg[0]
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.settimeout(None)
        tune(sock)
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
        call = self._book.open(range(self.world_size), getattr(fn, "__name__", "call"))
        msg = [(call, fn, args, kwargs)]
        try:
            dist.broadcast_object_list(msg, src=0, group=self._control)
        except Exception as exc:  # a peer's connection closed: its process is gone
            self.dead_reason = f"a rank is unreachable ({type(exc).__name__})"
            raise
        mine = run_call(fn, self.ctx, args, kwargs)
        if mine[0] == "error" and fn is not heartbeat:  # peers may wait in a collective for us: do not gather
            self.dead_reason = f"rank 0 raised {mine[1][0]} during {getattr(fn, '__name__', 'a call')}"
            self._book.take(range(self.world_size))
            raise RemoteError({0: mine[1]})
        try:
            return self._finish(call, mine)
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
        links, what = self._links, getattr(fn, "__name__", "call")
        with links.cond:
            busy = [r for r in ranks if r in self._book.replies]
            if not busy:
                call = self._book.open(ranks, what)
        if busy:
            raise RuntimeError(f"rank(s) {busy} still hold an answer nobody collected (a bug in the caller)")
        for r in ranks:
            try:
                links.send(r, (call, fn, tuple(args_per_rank[r]), kwargs or {}))
            except OSError as exc:
                links._lost(r, f"its control connection failed: {exc}")
                raise RuntimeError(f"the joined world failed during {what}: {self.dead_reason}") from exc
        return ranks

    def answered(self, ranks: list[int]) -> bool:
        """Whether every one of these ranks has answered its submitted call (`collect_some` will not wait)."""
        with self._links.cond:
            return self._book.has(ranks)

    def wait_any(self, ranks: list[int], timeout_s: float) -> None:
        """Block until one of these ranks answers (or a rank is gone, or timeout_s passes)."""
        links = self._links
        with links.cond:
            links.cond.wait_for(lambda: self.dead_reason is not None or any(r in self._book.replies for r in ranks),
                                timeout_s)

    def collect_some(self, ranks: list[int], what: str = "call") -> list[Any]:
        """The answers of a `submit_some` call's ranks, in rank order. Raises `RemoteError` when ranks raised (after
        `fail_grace_s` for the others, which may be stuck in a collective with them), RuntimeError when a rank is
        gone or none answered within the timeout. Whatever happens, those calls end here: a reply still to come is
        dropped when it arrives."""
        with self._links.cond:
            try:
                self._await(ranks, what)
            finally:
                got = self._book.take(ranks)
        errors = {r: payload for r, (status, payload) in got.items() if status == "error"}
        if errors:
            raise RemoteError(errors)
        return [got[r][1] for r in ranks]

    def _await(self, ranks: list[int], what: str) -> None:
        """Under the links' condition: wait until every one of `ranks` has answered, or some raised and the others
        stayed silent for `fail_grace_s`; RuntimeError when a rank is gone or nothing came within the timeout."""
        deadline = time.monotonic() + self.timeout_s + 30.0
        first_error = None
        while True:
            errors = self._book.errors(ranks)
            if self._book.has(ranks) or (errors and first_error is not None
                                         and time.monotonic() - first_error > self.fail_grace_s):
                return
            if errors and first_error is None:
                first_error = time.monotonic()
            if self.dead_reason is not None and not errors:
                raise RuntimeError(f"the joined world failed during {what}: {self.dead_reason}")
            if time.monotonic() > deadline:
                self.dead_reason = self.dead_reason or f"no answer to {what} within {self.timeout_s + 30:.0f} s"
                raise RuntimeError(f"the joined world failed during {what}: {self.dead_reason}")
            self._links.cond.wait(0.1 if first_error is not None or self.dead_reason is not None else 1.0)

    def abandon(self, ranks: list[int]) -> None:
        """Subset mode: give up the calls in flight on these ranks without collecting them (an engine closing with
        a call in flight): their replies are dropped when they come."""
        with self._links.cond:
            self._book.take(ranks)

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

    def _finish(self, call: int, mine: tuple) -> list[Any]:
        """Broadcast mode: gather every rank's (call id, status, payload) for call `call` at rank 0 and return the
        payloads in rank order (RemoteError when ranks raised); a reply to another call is dropped, and fails it."""
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object((call, *mine), gathered, dst=0, group=self._control)
        if self.rank != 0:
            return []
        for r, (answered, status, payload) in enumerate(gathered):
            self._book.file(answered, r, status, payload)
        replies = self._book.take(range(self.world_size))
        errors = {r: payload for r, (status, payload) in replies.items() if status == "error"}
        if errors:
            raise RemoteError(errors)
        missing = [r for r in range(self.world_size) if r not in replies]
        if missing:
            raise RuntimeError(f"rank(s) {missing} answered another call than call {call}")
        return [replies[r][1] for r in range(self.world_size)]

    # ------------------------------------------------------------------ the other ranks
    def serve_forever(self) -> None:
        """Ranks other than 0: run calls from rank 0 until it shuts down, then exit the process."""
        leave_shutdown_to_driver()
        while (msg := self._next_call()) is not None:
            call, fn, args, kwargs = msg  # call: its id, which the reply carries back
            mine = run_call(fn, self.ctx, args, kwargs)
            if self.subsets:  # an error too: rank 0 reports it before it sees the connection close
                mine = self._send_reply(call, fn, mine)
            if mine[0] == "error":  # exit now: peers stuck in a collective with us fail at once, torchrun ends the job
                exit_after_error(self.rank, fn.__name__, mine[1])
            if not self.subsets:
                self._finish(call, mine)
        if self._link is not None:
            self._link.close()
        dist.destroy_process_group()
        raise SystemExit(0)

    def _next_call(self) -> tuple | None:
        """A rank other than 0: the next call (call id, fn, args, kwargs) from rank 0, None when it shuts down."""
        if not self.subsets:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self._control)
            return box[0]
        try:
            return recv_frame(self._link)
        except (OSError, ConnectionError) as exc:
            raise RuntimeError(f"rank {self.rank}: the driver (rank 0) is gone: {exc}") from None

    def _send_reply(self, call: int, fn: Callable, mine: tuple) -> tuple:
        """Subset mode: reply (call id, status, payload) to rank 0; what was sent (an unpicklable result: an error)."""
        try:
            send_frame(self._link, (call, *mine))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            mine = ("error", (type(exc).__name__, f"the result of {fn.__name__} cannot be sent: {exc}",
                              traceback.format_exc()))
            send_frame(self._link, (call, *mine))
        return mine

    def close(self, force: bool = False) -> None:
        if self._closed or self.rank != 0:
            return
        self._closed = True
        if self._links is not None:
            for r in self._links.socks:  # ranks inside a call read it when they are done (it waits in the socket)
                try:
                    send_frame(self._links.socks[r], None)
                except OSError:  # that rank is gone
                    pass
            left = self._links.close(wait_s=1.0 if force or self.dead_reason is not None else self.timeout_s)
            if left:
                dist.destroy_process_group()
            return
        if self.dead_reason is None:  # with a peer gone, the broadcast could wait for ever: the job ends with us
            dist.broadcast_object_list([None], src=0, group=self._control)
        dist.destroy_process_group()
