"""The FastAPI app of `cpinfer serve`: OpenAI routes as a thin layer over `AsyncLLM` (docs/engine.md).

Each request is validated (pydantic, then `AsyncLLM.add_request`, which checks the prompt against the model length)
before any byte is streamed, so bad input is a 400 and never reaches the ranks. A multi-turn chat resends its
history; the engine's prefix tree finds the earlier turns' K/V still sharded over the CP ranks (persistent KV, paper
§3.3) and `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were reused.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError, error_body, error_response, install_error_handlers
from cpinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from cpinfer.server.outputs import Progress, chat_logprobs, completion_logprobs, usage
from cpinfer.utils import get_logger

log = get_logger()
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI completions default for max_tokens
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the routes need besides the engine: the public model name, its source and the optional API key."""

    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None

    def __post_init__(self):
        if not self.served_model_name or not self.served_model_name.strip():
            raise ValueError("served_model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given (leave it out to disable authentication)")


class OpenAIServer:
    """Routes and helpers bound to one engine. `engine` follows the `AsyncLLM` API of docs/engine.md."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_model_len = int(engine.max_model_len)
        self.metrics = ServerMetrics(config.served_model_name, engine.stats, lambda: bool(engine.errored))

    # ------------------------------------------------------------------ checks
    def count_error(self, request: Request, status: int) -> None:
        """Error responses of the generation routes count as `rejected` (4xx) or `error` (5xx)."""
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            self.metrics.outcome(endpoint, "rejected" if status < 500 else "error")

    async def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(400, f"the model '{name}' does not exist; this server serves "
                                f"'{self.config.served_model_name}'", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.engine.errored:
            raise APIError(500, f"the engine is dead: {self.engine.dead_error}", code="engine_dead")

    def _failure(self, exc: BaseException) -> APIError:
        if self.engine.errored:
            return APIError(500, f"the engine is dead: {self.engine.dead_error}", code="engine_dead")
        return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error")

    def sampling_params(self, req: P._SamplingRequest, max_tokens: int, top_logprobs: int, logprobs: bool):
        from cpinfer import SamplingParams

        try:
            return SamplingParams(**req.sampling_kwargs(max_tokens, top_logprobs, logprobs))
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_parameter") from None

    def add_request(self, request_id: str, prompt, params, param: str):
        self.check_alive()
        try:
            return self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:  # empty / over-long prompt, bad token ids: the engine names the numbers
            raise APIError(400, str(exc), param=param, code="invalid_prompt") from None

    # ------------------------------------------------------------------ running a request
    async def collect(self, request_id: str, stream, http_request: Request, endpoint: str, t0: float):
        """Drain a stream to its final output; abort it if the client goes away first."""

        async def drain():
            last = None
            async for out in stream:
                last = out
            return last

        async def disconnected():
            while True:
                message = await http_request.receive()
                if message["type"] == "http.disconnect":
                    return

        work, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                out = work.result()  # raises what the stream raised
                self.finished(out, endpoint, t0)
                return out
            self.metrics.outcome(endpoint, "abort")
            return None
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a dead rank or an engine bug: 500 with the reason
            raise self._failure(exc) from None
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                self.abort(request_id)
                await self._close(stream)

    def abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except (ValueError, KeyError):  # it finished (or failed) meanwhile: nothing left to abort
            pass
        except Exception as exc:  # noqa: BLE001 - a dead engine cannot abort; the request is gone with it
            log.debug("abort of %s failed: %s", request_id, exc)

    async def _close(self, stream) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await stream.aclose()
            except Exception:  # noqa: BLE001 - closing an aborted or failed stream may raise; nothing to save
                pass

    def finished(self, out, endpoint: str, t0: float) -> None:
        self.metrics.outcome(endpoint, out.finish_reason or "stop")
        m = out.metrics or {}
        self.metrics.latencies(m.get("ttft_s"), list(m.get("ttit_s") or []), time.monotonic() - t0)

    async def sse(self, request_id: str, stream, chunks: Callable[[Any, Progress], list[dict]],
                  usage_chunk: Callable[[Any], dict] | None, endpoint: str, t0: float) -> AsyncIterator[str]:
        """Server-sent events: one `data:` line per chunk, an error event if the engine fails, then [DONE]."""
        progress = Progress()
        complete = False
        try:
            for first in chunks(None, progress):
                yield f"data: {json.dumps(first)}\n\n"
            async for out in stream:
                for chunk in chunks(out, progress):
                    yield f"data: {json.dumps(chunk)}\n\n"
            complete = True
            if progress.last is not None:
                self.finished(progress.last, endpoint, t0)
                if usage_chunk is not None:
                    yield f"data: {json.dumps(usage_chunk(progress.last))}\n\n"
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in the stream, then end it
            complete = True
            self.metrics.outcome(endpoint, "error")
            err = self._failure(exc)
            log.warning("request %s failed: %s", request_id, err.message)
            yield f"data: {json.dumps(error_body(err.status, err.message, code=err.code))}\n\n"
        finally:
            if not complete:  # the client disconnected (we were cancelled) or the server is stopping
                self.abort(request_id)
                self.metrics.outcome(endpoint, "abort")
                await self._close(stream)
        yield "data: [DONE]\n\n"


def dump(model) -> dict:
    return model.model_dump()


# ---------------------------------------------------------------------------------------------- the app
def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app for one engine (shut the engine down yourself after the server stops)."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="cpinfer", description="OpenAI-compatible context-parallel inference server")
    app.state.server = server
    install_error_handlers(app, server.count_error)
    auth = [Depends(server.check_auth)]
    name = config.served_model_name
    tok = server.tokenizer

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        server.count_error(request, 500)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")

    @app.get("/health")
    async def health():
        if engine.errored:
            return error_response(503, f"the engine is dead: {engine.dead_error}", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = P.ModelCard(id=name, root=config.model_path or name, max_model_len=server.max_model_len)
        return dump(P.ModelList(data=[card]))

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(req: P.TokenizeRequest):
        server.check_model(req.model)
        if tok is None:
            raise APIError(400, "the model has no tokenizer", code="no_tokenizer")
        try:
            ids = (list(engine.encode_chat(P.ChatCompletionRequest(messages=req.messages).plain_messages()))
                   if req.messages is not None else tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages" if req.messages else "prompt") from None
        return dump(P.TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(req: P.DetokenizeRequest):
        server.check_model(req.model)
        if tok is None:
            raise APIError(400, "the model has no tokenizer", code="no_tokenizer")
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:8]}", param="tokens")
        return dump(P.DetokenizeResponse(prompt=tok.decode(req.tokens)))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: P.CompletionRequest, http_request: Request):
        t0 = time.monotonic()
        server.check_model(req.model)
        try:
            prompt = req.single_prompt()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from None
        top = int(req.logprobs or 0)
        params = server.sampling_params(req, req.max_tokens or DEFAULT_COMPLETION_TOKENS, top, req.logprobs is not None)
        rid, created = P.new_id("cmpl"), int(time.time())
        stream = server.add_request(rid, prompt, params, "prompt")
        if not req.stream:
            out = await server.collect(rid, stream, http_request, "completions", t0)
            if out is None:
                return Response(status_code=499)
            lp = completion_logprobs(tok, out, range(len(out.token_ids)), 0) if req.logprobs is not None else None
            choice = P.CompletionChoice(text=out.text or "", logprobs=lp, finish_reason=out.finish_reason,
                                        stop_reason=out.stop_reason if hasattr(out, "stop_reason") else None)
            return dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[choice], usage=usage(out)))

        def chunks(out, progress: Progress) -> list[dict]:
            if out is None:
                return []
            start = progress.chars
            delta, new = progress.advance(out)
            if not delta and not len(new) and not out.finished:
                return []
            lp = completion_logprobs(tok, out, new, start) if req.logprobs is not None else None
            choice = P.CompletionChoice(text=delta, logprobs=lp, finish_reason=out.finish_reason if out.finished
                                        else None, stop_reason=getattr(out, "stop_reason", None) if out.finished
                                        else None)
            body = dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[choice]))
            if not req.include_usage:
                body.pop("usage")
            return [body]

        def usage_chunk(out) -> dict:
            return dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[], usage=usage(out)))

        return StreamingResponse(server.sse(rid, stream, chunks, usage_chunk if req.include_usage else None,
                                            "completions", t0), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(req: P.ChatCompletionRequest, http_request: Request):
        t0 = time.monotonic()
        server.check_model(req.model)
        server.check_alive()
        try:
            ids = list(engine.encode_chat(req.plain_messages()))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_prompt") from None
        if not ids:
            raise APIError(400, "messages produced an empty prompt", param="messages", code="invalid_prompt")
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, server.max_model_len - len(ids))
        top = int(req.top_logprobs or 0)
        params = server.sampling_params(req, max_tokens, top, req.logprobs)
        rid, created = P.new_id("chatcmpl"), int(time.time())
        stream = server.add_request(rid, ids, params, "messages")
        if not req.stream:
            out = await server.collect(rid, stream, http_request, "chat", t0)
            if out is None:
                return Response(status_code=499)
            lp = chat_logprobs(tok, out, range(len(out.token_ids))) if req.logprobs else None
            choice = P.ChatChoice(message=P.AssistantMessage(content=out.text or ""), logprobs=lp,
                                  finish_reason=out.finish_reason, stop_reason=getattr(out, "stop_reason", None))
            return dump(P.ChatCompletionResponse(id=rid, created=created, model=name, choices=[choice],
                                                  usage=usage(out)))

        def chunk(choice: P.ChatChunkChoice) -> dict:
            body = dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[choice]))
            delta = body["choices"][0]["delta"]
            body["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}  # as OpenAI sends it
            if not req.include_usage:
                body.pop("usage")
            return body

        def chunks(out, progress: Progress) -> list[dict]:
            if out is None:  # the opening chunk carries the role
                return [chunk(P.ChatChunkChoice(delta=P.DeltaMessage(role="assistant", content="")))]
            delta, new = progress.advance(out)
            if not delta and not len(new) and not out.finished:
                return []
            lp = chat_logprobs(tok, out, new) if req.logprobs else None
            done = out.finished
            return [chunk(P.ChatChunkChoice(delta=P.DeltaMessage(content=delta), logprobs=lp,
                                            finish_reason=out.finish_reason if done else None,
                                            stop_reason=getattr(out, "stop_reason", None) if done else None))]

        def usage_chunk(out) -> dict:
            return dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[], usage=usage(out)))

        return StreamingResponse(server.sse(rid, stream, chunks, usage_chunk if req.include_usage else None,
                                            "chat", t0), media_type="text/event-stream")

    return app
