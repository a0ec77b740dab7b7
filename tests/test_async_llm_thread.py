"""`AsyncLLM` builds its engine in the thread that steps it (one OpenMP team per process: a second thread's team
beside the start-up thread's made every small GEMM of a served decode step wait for parked workers), and a
start-up failure still reaches the constructor's caller as the error it was. A fake engine: no rank, no process."""
from __future__ import annotations

import threading
import time

import pytest

from cpinfer.engine import async_llm


class FakeEngine:
    """What `AsyncLLM` calls on an engine, recording the thread of each call."""

    def __init__(self):
        self.threads = {"build": threading.current_thread().name}
        self.before_forward = None
        self.last_step_host = {}

    def _seen(self, what: str) -> None:
        self.threads.setdefault(what, threading.current_thread().name)

    def cache_stats(self) -> dict:
        return {}

    def stats(self):
        return None

    def queue_counts(self) -> tuple[int, int]:
        return 0, 0

    def has_unfinished_requests(self) -> bool:
        self._seen("loop")
        return False

    def check_ranks(self):
        return None

    def rank_failure(self):
        return None

    def sync_tiers(self) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def shutdown(self) -> None:
        self._seen("shutdown")


def test_the_engine_is_built_in_the_thread_that_steps_it(monkeypatch):
    monkeypatch.setattr(async_llm, "make_engine", lambda model, **kw: FakeEngine())
    llm = async_llm.AsyncLLM("unused")
    try:
        deadline = time.monotonic() + 30
        while "loop" not in llm.engine.threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.engine.threads["build"] == llm.engine.threads["loop"] == "cpinfer-engine"
        assert threading.current_thread().name != "cpinfer-engine"
    finally:
        llm.shutdown()
    assert not llm._thread.is_alive()


def test_a_start_up_error_reaches_the_constructor(monkeypatch):
    def fail(model, **kw):
        raise ValueError("max_model_len (9) exceeds what the KV cache holds")

    monkeypatch.setattr(async_llm, "make_engine", fail)
    with pytest.raises(ValueError, match="exceeds what the KV cache holds"):
        async_llm.AsyncLLM("unused")


def test_a_torchrun_rank_other_than_0_serves_in_the_calling_thread(monkeypatch):
    """Under torchrun a rank other than 0 serves inside `make_engine` (it installs signal handlers, which only the
    main thread may) until rank 0 shuts down, then leaves with SystemExit (`JoinedWorld.serve_forever`)."""
    calls = []

    def serve(model, **kw):
        calls.append(threading.current_thread().name)
        raise SystemExit(0)

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(async_llm, "make_engine", serve)
    with pytest.raises(SystemExit):
        async_llm.AsyncLLM("unused")
    assert calls == [threading.current_thread().name]
