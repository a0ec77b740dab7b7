"""Replies never cross calls: every call carries an id and every reply the id of the call it answers, so a reply to
a call nobody awaits any more (abandoned when an engine closed, or left by a caller that failed mid-call) is dropped
with a warning instead of being read by the next call on the same ranks. One pool serves every test here."""
from __future__ import annotations

import time

import pytest

from cpinfer.launch import WorkerPool, driver_can_host_rank
from cpinfer.launch.calls import CallBook

pytestmark = pytest.mark.timeout(300)


def _tagged(ctx, seconds: float, tag: str) -> dict:
    """A reply that says which call it answers (a dict, as the engine's replies that crossed calls were)."""
    time.sleep(seconds)
    return {"rank": ctx.rank, "tag": tag}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(3, timeout_s=60, fail_grace_s=1.0, driver_rank=driver_can_host_rank())
    yield p
    p.close(force=True)


def _stale(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("dropped a stale reply")]


def test_an_abandoned_call_s_late_replies_are_dropped_not_read_by_the_next_call(pool, cpinfer_warnings):
    dropped = pool._book.dropped
    ranks = pool.submit_some(_tagged, {1: (0.5, "old"), 2: (0.5, "old")})  # slow on the ranks
    pool.abandon(ranks)  # the engine closed with it in flight
    assert pool.run(_tagged, 0.0, "new") == [{"rank": r, "tag": "new"} for r in range(3)]
    assert pool._book.dropped == dropped + 2
    stale = _stale(cpinfer_warnings)
    assert len(stale) == 2 and all("(ok) of rank" in m and "call" in m for m in stale)
    assert all("old" not in m for m in cpinfer_warnings)  # a short description, no payload


def test_a_submission_left_uncollected_is_superseded_and_polling_skips_its_reply(pool, cpinfer_warnings):
    pool.submit_some(_tagged, {1: (0.3, "lost")})  # a caller that failed mid-call: never collected nor abandoned
    ranks = pool.submit_some(_tagged, {1: (0.0, "mine")})
    assert any("was not collected" in m for m in cpinfer_warnings)
    deadline = time.monotonic() + 30
    while not pool.answered(ranks) and time.monotonic() < deadline:
        pool.wait_any(ranks, 0.5)  # wakes for the stale reply too, which is dropped
    assert pool.answered(ranks)
    assert pool.collect_some(ranks) == [{"rank": 1, "tag": "mine"}]
    assert len(_stale(cpinfer_warnings)) == 1


def test_the_call_book_keeps_only_the_awaited_reply():
    book = CallBook()
    first = book.open([1, 2], "first")
    assert book.file(first, 1, "ok", "a") and not book.has([1, 2])
    second = book.open([2], "second")  # rank 2's first call is superseded
    assert second == first + 1
    assert not book.file(first, 2, "ok", "stale") and book.dropped == 1
    assert not book.file(first, 1, "ok", "again") and book.dropped == 2  # one reply per call
    assert book.file(second, 2, "error", ("ValueError", "m", "tb"))
    assert book.errors([1, 2]) == {2: ("ValueError", "m", "tb")}
    assert book.take([1, 2]) == {1: ("ok", "a"), 2: ("error", ("ValueError", "m", "tb"))}
    assert not book.file(second, 2, "ok", "late") and book.awaited == {} and book.replies == {}
