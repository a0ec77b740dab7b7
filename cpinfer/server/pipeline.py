"""The one request pipeline every generation route runs: validate → prompt ids → sampling params → add to the engine
→ collect or stream → usage. Each API (completions.py, chat.py, messages.py, responses.py) is an `API` subclass that
translates its request in (`prepare`: a `Job`) and its response out (`response`, or stream `events`); what happens
between — engine requests per choice, disconnects, failures, metrics, server-sent events — happens here once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from typing import Any, AsyncIterator, Callable, ClassVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from cpinfer.server.errors import APIError, error_body
from cpinfer.server.outputs import Progress
from cpinfer.server.state import OpenAIServer, json_bytes, log_request, request_id
from cpinfer.server.streaming import GuardedSSE
from cpinfer.utils import get_logger

log = get_logger()


@dataclasses.dataclass
class Job:
    """An API request translated for the engine: one prompt (token ids) and `SamplingParams` per choice; `param`
    is the request field a prompt the engine refuses is blamed on."""

    prompts: list[list[int]]
    params: list
    param: str


class API:
    """One API's translation in and out. Subclasses set the class attributes and implement `prepare` and
    `response`; streamed, `events` (per output of choice i), `closing` (after the last output) and `error_event`."""

    request_model: ClassVar[type]
    endpoint: ClassVar[str]  # the metrics label and the log's
    id_prefix: ClassVar[str]  # the response id is this + the request id
    done_line: ClassVar[str | None] = "data: [DONE]\n\n"  # what ends a stream (OpenAI's marker; None: nothing)

    def __init__(self, server: OpenAIServer, req, rid: str):
        self.server, self.req, self.rid = server, req, rid
        self.created = int(time.time())

    @property
    def streaming(self) -> bool:
        return bool(getattr(self.req, "stream", False))

    def check(self) -> None:
        """Request-level checks before any work (the model name, a live engine)."""
        self.server.check_model(getattr(self.req, "model", None))
        self.server.check_alive()

    async def prepare(self) -> Job:
        raise NotImplementedError

    def response(self, outs: list) -> Any:
        """The whole response (a pydantic model or a dict) of the choices' final outputs, built off the event loop."""
        raise NotImplementedError

    def events(self, i: int, out, progress: Progress) -> list[dict]:
        """The stream events one output of choice i adds (`progress` is what was sent of that choice so far)."""
        raise NotImplementedError

    def closing(self, outs: list) -> list[dict]:
        """Events after every choice's last output (usage, end-of-message)."""
        return []

    def error_event(self, err: APIError) -> dict:
        return error_body(err.status, err.message, code=err.code)

    def frame(self, event: dict) -> str:
        """One event as server-sent-event text."""
        return f"data: {json.dumps(event)}\n\n"

    def finished(self, outs: list) -> None:
        """Called once with the final outputs of a request that completed (streamed or not)."""


async def run(server: OpenAIServer, http_request: Request, api_type: type[API]):
    """The pipeline: parse and check the body, let the API translate it, run it, translate the outputs back."""
    t0 = time.monotonic()
    req = await server.parse(http_request, api_type.request_model)
    api = api_type(server, req, f"{api_type.id_prefix}{request_id(http_request)}")
    api.check()
    job = await api.prepare()
    log_request(api.rid, req)
    rids, streams = await add_requests(server, api.rid, job.prompts, job.params, job.param)
    if not api.streaming:
        outs = await collect(server, rids, streams, http_request, api.endpoint, t0)
        if outs is None:
            return Response(status_code=499)
        api.finished(outs)
        return await respond(lambda: api.response(outs))
    return stream_response(server, rids, sse(server, api, rids, streams, t0))


# ---------------------------------------------------------------------------------------------- the engine side
async def add_requests(server: OpenAIServer, rid: str, prompts: list, params: list,
                       param: str) -> tuple[list[str], list]:
    """One engine request per choice (`rid-i`), all validated before any is queued; aborted again if a later one
    fails to queue."""
    server.check_alive()
    engine = server.engine
    try:
        checked = [await server.prompts.run(engine.validate, p, sp) for p, sp in zip(prompts, params)]
    except ValueError as exc:  # empty / over-long prompt, bad token ids: the engine names the numbers
        raise APIError(400, str(exc), param=getattr(exc, "param", param), code="invalid_prompt") from None
    rids = [rid] if len(checked) == 1 else [f"{rid}-{i}" for i in range(len(checked))]
    streams = []
    try:
        for r, ids, sp in zip(rids, checked, params):
            streams.append(engine.add_request(r, ids, sp))
    except ValueError as exc:
        for r in rids[:len(streams)]:
            abort(server, r)
        raise APIError(400, str(exc), param=param, code="invalid_prompt") from None
    return rids, streams


async def collect(server: OpenAIServer, rids: list[str], streams: list, http_request: Request, endpoint: str,
                  t0: float):
    """Drain every stream to its final output (a list, in order); abort them all if the client goes away first
    (None) or one fails (raised as an APIError). Every task started here is awaited or cancelled and its outcome
    read, so a disconnect leaves nothing for asyncio to report."""

    async def drain(stream):
        last = None
        async for out in stream:
            last = out
        return last

    works = [asyncio.ensure_future(drain(s)) for s in streams]
    watch = asyncio.ensure_future(_disconnected(http_request))
    try:
        if not await _all_before(works, watch):
            log.info("request %s: the client disconnected before the response; aborted", rids[0])
            server.metrics.outcome(endpoint, "abort")
            return None
        outs = [w.result() for w in works]
        for out in outs:
            finished(server, out, endpoint, t0)
        return outs
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - a dead rank, this request's own failure, or a bug
        raise server.failure(exc, rids[0]) from None
    finally:
        _settle(watch)
        for rid, work, stream in zip(rids, works, streams):
            if not work.done():
                abort(server, rid)
                await _close(stream)
            _settle(work)


def abort(server: OpenAIServer, request_id: str) -> None:
    try:
        server.engine.abort(request_id)
    except (ValueError, KeyError):  # it finished (or failed) meanwhile: nothing left to abort
        pass
    except Exception as exc:  # noqa: BLE001 - a dead engine cannot abort; the request is gone with it
        log.debug("abort of %s failed: %s", request_id, exc)


async def _close(stream) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except Exception:  # noqa: BLE001 - closing an aborted or failed stream may raise; nothing to save
            pass


def finished(server: OpenAIServer, out, endpoint: str, t0: float) -> None:
    """Metrics (and with --enable-log-requests a log line) of one finished request."""
    server.metrics.outcome(endpoint, out.finish_reason if out.finish_reason in ("stop", "length", "abort")
                           else "stop")
    m = out.metrics or {}
    e2e = time.monotonic() - t0
    server.metrics.latencies(m.get("ttft_s"), list(m.get("ttit_s") or []), e2e, len(out.prompt_token_ids),
                             len(out.token_ids))
    if server.config.log_requests:
        ttft = m.get("ttft_s")
        log.info("request %s finished (%s): prompt %d tokens (%d cached), output %d tokens, TTFT %s, e2e %.3f s",
                 out.request_id, out.finish_reason, len(out.prompt_token_ids), out.num_cached_tokens,
                 len(out.token_ids), "n/a" if ttft is None else f"{ttft:.3f} s", e2e)


# ---------------------------------------------------------------------------------------------- the client side
async def respond(build: Callable[[], Any]) -> Response:
    """A whole response: `build()` makes its model (or dict) and `json_bytes` its body in a worker thread, so a
    large log-prob payload (n × echo) never stalls the event loop (/health, other streams)."""
    body = await anyio.to_thread.run_sync(lambda: json_bytes(build()))
    return Response(body, media_type="application/json")


def stream_response(server: OpenAIServer, rids: list[str], events) -> GuardedSSE:
    """The SSE response of streamed requests; a client that stops reading for the stall timeout is cut off and
    its requests aborted."""
    def stalled() -> None:
        for rid in rids:
            abort(server, rid)
    return GuardedSSE(events, server.config.stream_stall_timeout_s, stalled)


async def sse(server: OpenAIServer, api: API, rids: list[str], streams: list, t0: float) -> AsyncIterator[str]:
    """Server-sent events: the API's events for each output of any choice, an error event if a request fails, the
    closing events (usage) once all finished, then the API's end marker."""
    progress = [Progress() for _ in streams]
    complete = False
    try:
        async for i, out in _merged(streams):
            render = functools.partial(_events, api, i, out, progress[i])
            # an echo's prompt log-probs can be megabytes: built and serialised off the event loop
            yield await anyio.to_thread.run_sync(render) if out.prompt_logprobs is not None else render()
        complete = True
        lasts = [p.last for p in progress]
        if all(last is not None for last in lasts):
            for last in lasts:
                finished(server, last, api.endpoint, t0)
            api.finished(lasts)
            for event in api.closing(lasts):
                yield api.frame(event)
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in the stream, then end it
        complete = True
        server.metrics.outcome(api.endpoint, "error")
        yield api.frame(api.error_event(server.failure(exc, rids[0])))
        for rid in rids:  # the other choices stop too
            abort(server, rid)
    finally:
        if not complete:  # the client disconnected (we were cancelled) or the server is stopping
            for rid, stream in zip(rids, streams):
                abort(server, rid)
                await _close(stream)
            server.metrics.outcome(api.endpoint, "abort")
    if api.done_line is not None:
        yield api.done_line


def _events(api: API, i: int, out, progress: Progress) -> str:
    """The text of one output's events."""
    return "".join(api.frame(event) for event in api.events(i, out, progress))


async def _disconnected(http_request: Request) -> None:
    """Returns once the client has closed the connection."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


async def _all_before(works: list, watch) -> bool:
    """True once every work is done, False if `watch` ends first; the first work that fails raises its error."""
    pending = set(works)
    while pending:
        done, pending = await asyncio.wait({*pending, watch}, return_when=asyncio.FIRST_COMPLETED)
        for work in done - {watch}:
            if work.exception() is not None:
                raise work.exception()
        pending.discard(watch)
        if watch in done and pending:
            return False
    return True


def _settle(task) -> None:
    """Cancel a task still running; read a finished one's error (reported once already, or not needed): asyncio
    then has no "exception was never retrieved" to log."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


async def _merged(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) from several request streams as they come; the first failure is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                inbox.put_nowait((i, out, None))
            inbox.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            inbox.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out, exc = await inbox.get()
            if exc is not None:
                raise exc
            if out is None:
                left -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
