"""`AsyncLLM`: the engine for asyncio callers (the server). The step loop runs in one background thread; each
request is a stream of cumulative `RequestOutput`s delivered to the event loop as tokens are sampled. A stream holds
at most one output its reader has not taken (a newer cumulative output replaces an untaken one), so a reader that
falls behind costs one output's memory, not one per token.

Validation happens in the caller (`add_request` raises ValueError before anything is queued); aborting a stream
(`aclose()`, cancellation, a disconnected client) frees the request's blocks at the engine's next step. A request
whose own work fails (sampling, its grammar) raises `RequestFailedError` on its stream alone. If a rank dies or
raises inside a forward, every open stream raises `EngineDeadError` and `errored` turns True. A monitor thread reads
the ranks' watchers (`LLMEngine.rank_failure`: process sentinels, closed control connections) every few tens of
milliseconds, so a rank that dies is seen at once whether the engine is idle or inside a long step that does not
need that rank (rank 0's share of a draft model's k steps, a long prefill on rank 0 alone): that step may only find
out when it next sends the dead rank something, seconds later.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import queue
import threading
import time
from typing import AsyncIterator

from cpinfer.engine.llm import encode_chat
from cpinfer.engine.llm_engine import EngineDeadError, LLMEngine
from cpinfer.engine.pd import make_engine
from cpinfer.engine.request import RequestOutput
from cpinfer.engine.sampling import SamplingParams
from cpinfer.utils import get_logger

log = get_logger()
_IDLE_WAIT_S = 0.05
_HEARTBEAT_S = 1.0  # idle interval between liveness checks of ranks that have no process sentinel (torchrun)
_RANK_WATCH_S = 0.05  # how often the monitor thread reads the ranks' watchers (busy or idle)


class RequestFailedError(RuntimeError):
    """One request failed on its own (its sampling, its grammar); the engine and other requests go on.
    `reason` is for the server log; clients get a generic message with the request id."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id} failed")
        self.request_id, self.reason = request_id, reason


class RequestStream:
    """Async iterator over one request's outputs; the last has `finished=True`."""

    def __init__(self, owner: "AsyncLLM", request_id: str, prompt_token_ids: list[int]):
        self.owner, self.request_id = owner, request_id
        self._prompt = prompt_token_ids
        self._pending = None  # the newest output (or error) the reader has not taken yet
        self._latest: RequestOutput | None = None  # the newest output put, taken or not
        self._ready = asyncio.Event()
        self._done = False
        self.coalesced = 0  # outputs replaced by a newer one before the reader took them

    def _put(self, item) -> None:  # called on the event loop
        if isinstance(self._pending, BaseException) or (self._pending is not None and self._pending.finished):
            return  # an error or the final output is waiting: nothing replaces it
        if self._pending is not None:
            self.coalesced += 1
        if isinstance(item, RequestOutput):
            self._latest = item
        self._pending = item
        self._ready.set()

    def _cut(self) -> None:  # called on the event loop
        """End the stream now: a final output with what was generated so far and finish_reason "abort"."""
        last = self._latest or RequestOutput(request_id=self.request_id, prompt_token_ids=self._prompt, token_ids=[],
                                             text="", logprobs=None, prompt_logprobs=None, num_cached_tokens=0,
                                             finish_reason=None, metrics={})
        self._put(dataclasses.replace(last, finished=True, finish_reason="abort", stop_reason=None))

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self._done = True
            self.owner._forget(self.request_id)
            raise item
        if item.finished:
            self._done = True
            self.owner._forget(self.request_id)
        return item

    async def aclose(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self._done:
            self._done = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """`LLMEngine` driven by a background thread; `add_request` / `generate` / `abort` from the event loop."""

    def __init__(self, model: str | None = None, **kwargs):
        if os.environ.get("RANK", "0") != "0":  # a torchrun rank other than 0 serves inside make_engine, in this
            make_engine(model, **kwargs)  # (main) thread, until rank 0 shuts down; it leaves by SystemExit
            raise SystemExit(0)
        # The engine is built in the thread that will run its steps, so that this process's torch (OpenMP) threads
        # belong to that thread alone: a second thread's OpenMP team beside the start-up thread's leaves more
        # OpenMP threads than cores, and libgomp then parks its workers between parallel regions, so that every
        # small GEMM pays their wake-up (~0.1 ms: a CP1 decode step took 1.5x as long in a thread other than the
        # one that had loaded the model).
        built, failed = threading.Event(), []
        self._may_run = threading.Event()
        self._thread = threading.Thread(target=self._build_and_run, args=(model, kwargs, built, failed),
                                        name="cpinfer-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            raise failed[0]
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.dead_error: str | None = None
        self._snapshot = (self.engine.cache_stats(), self.engine.stats())  # refreshed by the engine thread
        # (running, waiting): published by the engine thread whenever they change, a long step's forward included
        self._queue = self.engine.queue_counts()
        self.engine.before_forward = self._publish_queue
        self._dying = threading.Lock()  # one of the engine thread and the monitor declares the engine dead
        self._may_run.set()  # the engine thread's step loop
        self._monitor = threading.Thread(target=self._watch_ranks, name="cpinfer-rank-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def rank_pids(self) -> list[int]:
        return list(self.engine.rank_pids)

    def encode_chat(self, messages) -> list[int]:
        return encode_chat(self.engine.tokenizer, messages)

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError (thread-safe: reads no mutable engine state; may tokenize)."""
        return self.engine.validate(prompt, params)

    def validate_grammar(self, grammar: str) -> None:
        """ValueError when a structured-output grammar cannot be used with this model (cached; thread-safe)."""
        self.engine.grammars.validate(grammar)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> RequestStream:
        """Validate now (ValueError with the numbers), queue, and return the request's stream."""
        if self.errored:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        tokens = self.engine.validate(prompt, params)
        self._loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, list(tokens))
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, tokens, params))
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request (no-op for unknown or finished ones)."""
        self._inbox.put(("abort", request_id, None, None))

    def abort_all(self) -> int:
        """End every open stream at once with a final output whose finish_reason is "abort" (what it generated so
        far), without waiting for a running step; the engine frees the requests at its next step. Thread-safe;
        returns how many streams were open."""
        loop, rids = self._loop, list(self._streams)
        if loop is not None and not loop.is_closed() and rids:
            loop.call_soon_threadsafe(self._cut, rids)
        return len(rids)

    def _cut(self, rids: list[str]) -> None:
        for rid in rids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream._cut()
            self.abort(rid)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def cache_stats(self) -> dict:
        """As of the last engine step (never waits for a running forward)."""
        return dict(self._snapshot[0])

    def stats(self):
        """`EngineStats` as of the last engine step, but for the queue sizes: those are the engine's now (a request
        counts as running while its step's forward is in progress)."""
        running, waiting = self._queue
        return dataclasses.replace(self._snapshot[1], num_running=running, num_waiting=waiting)

    # ------------------------------------------------------------------ the engine thread
    def _publish_queue(self) -> None:
        self._queue = self.engine.queue_counts()

    def _publish(self) -> None:
        self._snapshot = (self.engine.cache_stats(), self.engine.stats())
        self._publish_queue()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(stream._put, item)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            op, rid, tokens, params = item
            if op == "add":
                try:
                    self.engine.add_request(rid, tokens, params)
                except ValueError as exc:
                    self._deliver(rid, exc)
                except EngineDeadError:
                    raise
                except Exception as exc:  # noqa: BLE001 - this request's problem, not the engine's
                    self._deliver(rid, RequestFailedError(rid, f"{type(exc).__name__}: {exc}"))
            elif op == "abort" and rid in self.engine.requests:
                self.engine.abort(rid)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _die(self, reason: str) -> None:
        """The engine is dead (from the engine thread or the monitor, once): `errored` turns True (/health 503) and
        every open stream ends with `EngineDeadError`."""
        with self._dying:
            if self.dead_error is not None:
                return
            self.dead_error = reason
        self.engine.dead_error = self.engine.dead_error or reason  # the engine thread's next step raises
        log.error("engine loop stopped: %s", reason)
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("the engine failed"))

    def _watch_ranks(self) -> None:
        """The monitor thread: a rank seen gone by its pool's watcher kills the engine now, not when the engine
        thread's step (which may not need that rank for seconds) is over."""
        while not self._stop.wait(_RANK_WATCH_S) and self.dead_error is None:
            reason = self.engine.rank_failure()
            if reason is not None:
                self._die(f"{EngineDeadError.__name__}: {reason}")
                return

    def _build_and_run(self, model, kwargs: dict, built: threading.Event, failed: list) -> None:
        """The engine thread: build the engine (its start-up failure goes to the constructor), then step it."""
        try:
            self.engine = make_engine(model, **kwargs)  # LLMEngine, or prefill / decode groups
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor, in its thread
            failed.append(exc)
            return
        finally:
            built.set()
        self._may_run.wait()
        self._run()

    def _run(self) -> None:
        last_busy = time.monotonic()
        while not self._stop.is_set() and self.dead_error is None:
            try:
                self._drain(block=not self.engine.has_unfinished_requests())
                self._publish_queue()  # requests just queued wait
                dead = self.engine.check_ranks()  # a sentinel fired, even with nothing to do
                if dead is not None:
                    raise EngineDeadError(dead)
                if not self.engine.has_unfinished_requests():
                    self.engine.sync_tiers()  # idle: background disk writes go out, their acks come back
                    self._publish()
                    if time.monotonic() - last_busy > _HEARTBEAT_S:
                        self.engine.heartbeat()
                        last_busy = time.monotonic()
                    continue
                outputs = self.engine.step()
                t0 = time.perf_counter()
                last_busy = time.monotonic()
                self._publish()
                for out in outputs:
                    if out.error is not None:
                        self._deliver(out.request_id, RequestFailedError(out.request_id, out.error))
                    else:
                        self._deliver(out.request_id, out)
                # the step's outputs share its host timings: readers see the hand-off time once it is known
                self.engine.last_step_host["stream_s"] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - a dead rank or a bug: fail every request, stay inspectable
                self._die(f"{type(exc).__name__}: {exc}")
                return

    def shutdown(self) -> None:
        """Stop the loop thread and the ranks (in-flight requests end with an error)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self._monitor.join(timeout=5)
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError("the engine was shut down"))
        self.engine.shutdown()
