"""Waiting for a condition with a bound, instead of assuming how fast something settles (tests only).

On a busy machine (other test runs, a load of several per core) a background thread, a rank or a K/V transfer can
take many times longer than on an idle one. A test that needs a settled state waits for it here: polling at short
intervals (no cost when it is already there), failing with a message when the bound passes (so a hang still fails).
"""
from __future__ import annotations

import time

SETTLE_S = 120.0  # generous: what a loaded 2-core machine may need, still a failure if it hangs
# a dead rank is seen "within 2 s" on an idle machine (README, docs/serving.md: a watcher on the process sentinels);
# a loaded one may take longer to reap and schedule. Tests allow this much: far below the collective and read
# timeouts (60-120 s) that a missing watcher would fall back to, so a detection that hangs still fails
DEAD_RANK_SEEN_S = 15.0
# a node (a whole process) that lost a rank or its driver exits "in seconds": seen, then its shutdown; allowed this
# much on a loaded machine (the joined world's timeouts, that a hang would reach, are minutes)
DEAD_NODE_EXIT_S = 30.0


class _Bound:
    """`cond()` polled against a deadline: `check()` is its value when true, None while time is left, and an
    AssertionError once `timeout` seconds have passed (so a hang still fails)."""

    def __init__(self, cond, timeout: float, what: str):
        self.cond, self.timeout, self.what = cond, timeout, what
        self.deadline = time.monotonic() + timeout

    def check(self):
        got = self.cond()
        if got:
            return got
        if time.monotonic() >= self.deadline:
            raise AssertionError(f"{self.what} not reached within {self.timeout:.0f} s")
        return None


def wait_until(cond, timeout: float = SETTLE_S, interval: float = 0.02, what: str = "the condition"):
    """Poll `cond()` until it returns a true value (returned) or `timeout` seconds pass (AssertionError)."""
    bound = _Bound(cond, timeout, what)
    while not (got := bound.check()):
        time.sleep(interval)
    return got


async def async_wait_until(cond, timeout: float = SETTLE_S, interval: float = 0.02, what: str = "the condition"):
    """`wait_until` inside an event loop: awaits between polls, so the engine's loop keeps running."""
    import asyncio

    bound = _Bound(cond, timeout, what)
    while not (got := bound.check()):
        await asyncio.sleep(interval)
    return got


def settle(engine, timeout: float = SETTLE_S) -> list:
    """Step `engine` (an `LLMEngine` or `PDEngine`) until it has nothing unfinished: every request done, and for P/D
    every handoff, transfer and moved-back answer in. `generate` returns once its requests' outputs are final, which
    does not wait for those (a request that ended at its first token may still have its rows on their way). Returns
    the outputs the steps produced; AssertionError when it is not idle within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    outputs = []
    while engine.has_unfinished_requests():
        if time.monotonic() >= deadline:
            raise AssertionError(f"the engine did not settle within {timeout:.0f} s")
        outputs += engine.step()
    return outputs
