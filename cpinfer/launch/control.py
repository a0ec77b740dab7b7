"""The TCP control channel of a joined world in subset mode: pickled frames (length first), rank 0's address
for its ranks, and `RankLinks`, rank 0's end (one connection per rank, a reader thread, rank 0's worker thread)."""
from __future__ import annotations

import os
import pickle
import queue
import selectors
import socket
import threading
import time
from typing import Any

import torch

from cpinfer.launch.calls import CallBook
from cpinfer.launch.common import run_call


def send_frame(sock: socket.socket, obj: Any) -> None:
    """One control message: its length (8 bytes) then its pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = len(data).to_bytes(8, "little")
    if len(data) < (1 << 16):  # one segment for a decode step's small message
        sock.sendall(head + data)
    else:  # a large one without the copy
        sock.sendall(head)
        sock.sendall(data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the control connection closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Any:
    return pickle.loads(recv_exact(sock, int.from_bytes(recv_exact(sock, 8), "little")))


def tune(sock: socket.socket) -> None:
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


def accept_ranks(listen: socket.socket, token: bytes, world_size: int, timeout_s: float) -> dict[int, socket.socket]:
    """Rank 0: one connection from each other rank, which says its rank and presents the world's token first;
    closes `listen` when done."""
    socks: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    listen.settimeout(1.0)
    try:
        while len(socks) < world_size - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, world_size)) - set(socks))
                raise RuntimeError(f"rank(s) {missing} did not open their control connection to rank 0 within "
                                   f"{timeout_s:.0f} s")
            try:
                conn, _ = listen.accept()
            except socket.timeout:
                continue
            rank = _hello(conn, token)
            if rank is None or not 0 < rank < world_size or rank in socks:
                conn.close()  # not one of this world's ranks
                continue
            conn.settimeout(None)
            tune(conn)
            socks[rank] = conn
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        listen.close()
    return socks


def _hello(conn: socket.socket, token: bytes) -> int | None:
    """The rank a new connection says it is, or None when it does not present the token within 10 s."""
    conn.settimeout(10.0)
    try:
        hello = recv_exact(conn, 8 + len(token))
    except (OSError, ConnectionError):
        return None
    return int.from_bytes(hello[:8], "little") if hello[8:] == token else None


class RankLinks:
    """Rank 0's side of a subset-mode joined world: one TCP connection per other rank (pickled messages, length
    first), a reader thread that files each rank's answer as it arrives and notices a closed connection at once,
    and a worker thread that runs rank 0's own share of each call (so the driver thread stays free to submit and
    collect other groups' calls while rank 0 is inside a long one).

    The worker thread alone uses this process's data groups (world, roles) once the world is up; the driver thread
    alone uses the control group (at start-up), so no process group is ever used by two threads at once."""

    def __init__(self, world: "JoinedWorld", listen: socket.socket, token: bytes, timeout_s: float,
                 book: CallBook):
        self.world = world
        self.socks = accept_ranks(listen, token, world.world_size, timeout_s)  # rank -> its connection
        self.book = book  # the world's calls in flight; the reader files replies in it, always under `cond`
        self.cond = threading.Condition()
        self._buffers = {r: bytearray() for r in self.socks}
        self._wake_r, self._wake_w = os.pipe()  # close() ends the reader's select
        self._stop = False
        self._threads = torch.get_num_threads()
        self.inbox: Any = queue.SimpleQueue()  # rank 0's calls: (call id, fn, args, kwargs) or None to stop
        self.reader = threading.Thread(target=self._read, name="cpinfer-control-reader", daemon=True)
        self.worker = threading.Thread(target=self._work, name="cpinfer-rank0-worker", daemon=True)
        self.reader.start()
        self.worker.start()

    def _file(self, rank: int, reply: tuple) -> None:
        """reply: (call id, status, payload); a stale one is dropped (a rank that raised exits all the same)."""
        call, status, payload = reply
        with self.cond:
            if status == "error" and self.world.dead_reason is None:  # the rank exits (rank 0: stops driving)
                self.world.dead_reason = f"rank {rank} raised {payload[0]}: {payload[1]}"
            self.book.file(call, rank, status, payload)
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
            call, fn, args, kwargs = item
            # an error: peers may wait for rank 0 in a collective, the world is unusable now
            self._file(0, (call, *run_call(fn, self.world.ctx, args, kwargs)))

    def send(self, rank: int, msg: Any) -> None:
        if rank == 0:
            self.inbox.put(msg)
        else:
            send_frame(self.socks[rank], msg)

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
