"""Call ids and the replies that answer them: which call each rank's next reply must carry, so that a reply to a
call nobody awaits any more (abandoned, superseded, or left by a caller that failed) is dropped and logged, never
handed to another call."""
from __future__ import annotations

from typing import Any, Iterable

from cpinfer.utils import get_logger

log = get_logger()

START_UP = 0  # the id of the ranks' "ready" replies; calls count from 1


class CallBook:
    """The driver's record of its calls in flight on one world: per rank, the id of the call it owes a reply to and
    that reply once in. Its world alone uses it (WorkerPool: the driver thread; JoinedWorld: under its links'
    condition when a reader thread files the replies).

    On the wire a call carries its id and a reply is `(call id, rank, status, payload)` (over TCP the rank is the
    connection's), status "ok" / "error" / "ready", an error's payload (type name, message, traceback)."""

    def __init__(self):
        self.last = START_UP  # the id of the last call opened
        self.awaited: dict[int, int] = {}  # rank -> id of the call whose reply it owes
        self.replies: dict[int, tuple[str, Any]] = {}  # rank -> (status, payload) of that call, once in
        self.dropped = 0  # stale replies dropped so far

    def open(self, ranks: Iterable[int], what: str) -> int:
        """A new call on `ranks`: its id. A call those ranks still owed is abandoned (its reply will be dropped)."""
        self.last += 1
        self.expect(ranks, self.last, what)
        return self.last

    def expect(self, ranks: Iterable[int], call: int, what: str) -> None:
        for r in ranks:
            before = self.awaited.get(r)
            if before is not None:
                log.warning("rank %d: call %d was not collected before %s (call %d) was sent; its reply will be "
                            "dropped", r, before, what, call)
            self.awaited[r] = call
            self.replies.pop(r, None)

    def file(self, call: int, rank: int, status: str, payload: Any) -> bool:
        """Keep a reply if it answers the call `rank` owes (True); else drop it, with a warning."""
        owed = self.awaited.get(rank)
        if owed != call or rank in self.replies:
            self.dropped += 1
            log.warning("dropped a stale reply (%s) of rank %d to call %d: it owes %s", status, rank, call,
                        "nothing" if owed is None or rank in self.replies else f"call {owed}")
            return False
        self.replies[rank] = (status, payload)
        return True

    def has(self, ranks: Iterable[int]) -> bool:
        return all(r in self.replies for r in ranks)

    def errors(self, ranks: Iterable[int]) -> dict[int, tuple[str, str, str]]:
        """rank -> (type name, message, traceback) of the replies in that are errors."""
        return {r: self.replies[r][1] for r in ranks if r in self.replies and self.replies[r][0] == "error"}

    def take(self, ranks: Iterable[int]) -> dict[int, tuple[str, Any]]:
        """End the calls of `ranks`: the replies that came in, by rank; a reply still to come is dropped then."""
        out = {}
        for r in ranks:
            self.awaited.pop(r, None)
            if r in self.replies:
                out[r] = self.replies.pop(r)
        return out
