"""The FastAPI app of `cpinfer serve`: OpenAI routes as a thin layer over `AsyncLLM` (docs/engine.md).

Every request passes the guard (request id, API key before the body, body-size limit), then its body is parsed
strictly and its prompt templated and tokenized in a thread pool, never on the event loop; a bad request is a 400
before any compute. A multi-turn chat resends its history; the engine's prefix tree finds the earlier turns' K/V
still sharded over the CP ranks (persistent KV, paper §3.3) and `usage.prompt_tokens_details.cached_tokens` says
how many prompt tokens were reused. Failures reach clients as OpenAI errors carrying the request id, never as
tracebacks, paths or exception text; the details go to the server log under that id.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import ValidationError

from cpinfer.engine.async_llm import RequestFailedError
from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError, error_body, error_response, install_error_handlers, validation_message
from cpinfer.server.guard import GuardMiddleware
from cpinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from cpinfer.server.outputs import Progress, chat_logprobs, completion_logprobs, tool_calls, usage
from cpinfer.server.prompts import PromptEncoder, PromptError
from cpinfer.server.streaming import GuardedSSE
from cpinfer.utils import get_logger

log = get_logger()
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI completions default for max_tokens
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
DEAD_MESSAGE = "the engine is not running (a rank failed); the server must be restarted"


def default_max_request_bytes(max_model_len: int) -> int:
    """Room for a max_model_len prompt of plain text, JSON-escaped: 32 bytes per token, at least 1 MiB."""
    return max(1 << 20, 32 * max_model_len)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the routes need besides the engine: the public model name, the API key and the request limits."""

    served_model_name: str
    model_path: str | None = None  # for the log only: never sent to clients
    api_key: str | None = None
    max_request_bytes: int | None = None  # None: default_max_request_bytes(max_model_len)
    allow_special_tokens_in_content: bool = False
    enable_docs: bool = False
    stream_stall_timeout_s: float = 60.0  # a streaming client that takes no data this long is disconnected

    def __post_init__(self):
        if not self.served_model_name or not self.served_model_name.strip():
            raise ValueError("served_model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given (leave it out to disable authentication)")
        if self.max_request_bytes is not None and (not isinstance(self.max_request_bytes, int)
                                                   or self.max_request_bytes < 1024):
            raise ValueError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError(f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s!r}")


class OpenAIServer:
    """Routes and helpers bound to one engine. `engine` follows the `AsyncLLM` API of docs/engine.md."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_model_len = int(engine.max_model_len)
        self.max_request_bytes = config.max_request_bytes or default_max_request_bytes(self.max_model_len)
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len, config.allow_special_tokens_in_content)
        self.metrics = ServerMetrics(config.served_model_name, engine.stats, lambda: bool(engine.errored))

    # ------------------------------------------------------------------ checks
    def count_error(self, request: Request, status: int) -> None:
        """Error responses of the generation routes count as `rejected` (4xx) or `error` (5xx)."""
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            self.metrics.outcome(endpoint, "rejected" if status < 500 else "error")

    async def parse(self, request: Request, model: type):
        """The body as `model`, validated strictly in the tokenizer pool (a large body never blocks the loop)."""
        body = await request.body()
        try:
            return await self.prompts.run(model.model_validate_json, body)
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param, "invalid_parameter") from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(400, f"the model '{name}' does not exist; this server serves "
                                f"'{self.config.served_model_name}'", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.engine.errored:
            raise APIError(503, DEAD_MESSAGE, code="engine_dead")

    def failure(self, exc: BaseException, request_id: str) -> APIError:
        """What a client learns of a failure: a generic message and the request id; the log gets the details."""
        if isinstance(exc, APIError):
            return exc
        if self.engine.errored:
            return APIError(503, f"{DEAD_MESSAGE} (request id {request_id})", code="engine_dead")
        if isinstance(exc, RequestFailedError):
            log.error("request %s failed: %s", request_id, exc.reason)
        else:
            log.exception("request %s failed", request_id, exc_info=exc)
        return APIError(500, f"the request failed on the server; the server log has the details under request id "
                             f"{request_id}", code="request_failed")

    def sampling_params(self, req: P._SamplingRequest, max_tokens: int, top_logprobs: int, logprobs: bool,
                        grammar: str | None):
        from cpinfer import SamplingParams

        vocab = int(self.engine.config.vocab_size)
        bad = [k for k in (req.logit_bias or {}) if int(k) >= vocab]
        if bad:
            raise APIError(400, f"logit_bias: token ids must be below the vocabulary size {vocab}, got {bad[:5]}",
                           param="logit_bias", code="invalid_parameter")
        try:
            return SamplingParams(**req.sampling_kwargs(max_tokens, top_logprobs, logprobs), grammar=grammar)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_parameter") from None

    async def grammar(self, schema: dict | None, param: str) -> str | None:
        """The llguidance grammar for an output schema, validated against the tokenizer (in the pool)."""
        if schema is None:
            return None
        from cpinfer.engine.structured import json_schema_grammar

        def build() -> str:
            grammar = json_schema_grammar(schema)
            self.engine.validate_grammar(grammar)
            return grammar

        try:
            return await self.prompts.run(build)
        except ValueError as exc:
            raise APIError(400, str(exc)[:600], param=param, code="invalid_schema") from None

    async def add_request(self, request_id: str, prompt, params, param: str):
        self.check_alive()
        try:
            ids = await self.prompts.run(self.engine.validate, prompt, params)  # tokens, checked against limits
            return self.engine.add_request(request_id, ids, params)
        except ValueError as exc:  # empty / over-long prompt, bad token ids: the engine names the numbers
            raise APIError(400, str(exc), param=getattr(exc, "param", param), code="invalid_prompt") from None

    async def encode(self, fn: Callable, *args, param: str):
        try:
            return await self.prompts.run(fn, *args)
        except PromptError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_prompt") from None

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
        except Exception as exc:  # noqa: BLE001 - a dead rank, this request's own failure, or a bug
            raise self.failure(exc, request_id) from None
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
        self.metrics.outcome(endpoint, out.finish_reason if out.finish_reason in ("stop", "length") else "stop")
        m = out.metrics or {}
        self.metrics.latencies(m.get("ttft_s"), list(m.get("ttit_s") or []), time.monotonic() - t0)

    def stream_response(self, request_id: str, stream, chunks, usage_chunk, endpoint: str, t0: float) -> GuardedSSE:
        """The SSE response of a streamed request; a client that stops reading for the stall timeout is cut off."""
        return GuardedSSE(self.sse(request_id, stream, chunks, usage_chunk, endpoint, t0),
                          self.config.stream_stall_timeout_s, lambda: self.abort(request_id))

    async def sse(self, request_id: str, stream, chunks: Callable[[Any, Progress], list[dict]],
                  usage_chunk: Callable[[Any], dict] | None, endpoint: str, t0: float) -> AsyncIterator[str]:
        """Server-sent events: one `data:` line per chunk, an error event if the request fails, then [DONE]."""
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
            err = self.failure(exc, request_id)
            yield f"data: {json.dumps(error_body(err.status, err.message, code=err.code))}\n\n"
        finally:
            if not complete:  # the client disconnected (we were cancelled) or the server is stopping
                self.abort(request_id)
                self.metrics.outcome(endpoint, "abort")
                await self._close(stream)
        yield "data: [DONE]\n\n"


def dump(model) -> dict:
    body = model.model_dump()
    for choice in body.get("choices") or []:  # OpenAI leaves tool_calls out of a plain message
        if isinstance(choice.get("message"), dict) and choice["message"].get("tool_calls") is None:
            choice["message"].pop("tool_calls", None)
    return body


def _body_schema(model: type) -> dict:
    """`openapi_extra` declaring a route's JSON body (bodies are parsed by hand, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _install_openapi(app: FastAPI, models: list[type]) -> None:
    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ---------------------------------------------------------------------------------------------- the app
def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app for one engine (shut the engine down yourself after the server stops)."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="cpinfer", description="OpenAI-compatible context-parallel inference server",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json" if config.enable_docs else None)
    app.state.server = server
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_request_bytes=server.max_request_bytes)
    install_error_handlers(app, server.count_error)
    _install_openapi(app, [P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest])
    name = config.served_model_name
    tok = server.tokenizer
    prompts = server.prompts

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        server.count_error(request, 500)
        rid = request.scope.get("state", {}).get("request_id", "-")
        log.exception("request %s %s failed", rid, request.url.path, exc_info=exc)
        return error_response(500, f"internal error; the server log has the details under request id {rid}",
                              code="internal_error")

    @app.get("/health")
    async def health():
        if engine.errored:
            return error_response(503, DEAD_MESSAGE, code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    def card() -> P.ModelCard:
        return P.ModelCard(id=name, root=name, max_model_len=server.max_model_len)

    @app.get("/v1/models")
    async def models():
        return dump(P.ModelList(data=[card()]))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{name}'",
                           param="model", code="model_not_found")
        return dump(card())

    @app.post("/tokenize", openapi_extra=_body_schema(P.TokenizeRequest))
    async def tokenize(request: Request):
        req = await server.parse(request, P.TokenizeRequest)
        server.check_model(req.model)
        if req.messages is not None:
            ids = await server.encode(prompts.encode_chat, [m.for_template() for m in req.messages],
                                      req.add_generation_prompt is not False, param="messages")
        else:
            add = req.add_special_tokens is not False
            ids = await server.encode(prompts.encode_text, req.prompt, add, param="prompt")
        return dump(P.TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids))

    @app.post("/detokenize", openapi_extra=_body_schema(P.DetokenizeRequest))
    async def detokenize(request: Request):
        req = await server.parse(request, P.DetokenizeRequest)
        server.check_model(req.model)
        if tok is None:
            raise APIError(400, "the model has no tokenizer", code="no_tokenizer")
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:8]}", param="tokens")
        text = await prompts.run(tok.decode, req.tokens)
        return dump(P.DetokenizeResponse(prompt=text))

    @app.post("/v1/completions", openapi_extra=_body_schema(P.CompletionRequest))
    async def completions(http_request: Request):
        t0 = time.monotonic()
        req = await server.parse(http_request, P.CompletionRequest)
        server.check_model(req.model)
        server.check_alive()
        try:
            prompt = req.single_prompt()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from None
        if isinstance(prompt, str):
            prompt = await server.encode(prompts.encode_text, prompt, True, param="prompt")
        schema = req.response_format.output_schema() if req.response_format is not None else None
        grammar = await server.grammar(schema, "response_format")
        top = int(req.logprobs or 0)
        params = server.sampling_params(req, req.max_tokens or DEFAULT_COMPLETION_TOKENS, top,
                                        req.logprobs is not None, grammar)
        rid, created = f"cmpl-{_request_id(http_request)}", int(time.time())
        _log_request(http_request, rid, req)
        stream = await server.add_request(rid, prompt, params, "prompt")
        if not req.stream:
            out = await server.collect(rid, stream, http_request, "completions", t0)
            if out is None:
                return Response(status_code=499)
            lp = completion_logprobs(tok, out, range(len(out.token_ids)), 0) if req.logprobs is not None else None
            choice = P.CompletionChoice(text=out.text or "", logprobs=lp, finish_reason=out.finish_reason,
                                        stop_reason=out.stop_reason)
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
                                        else None, stop_reason=out.stop_reason if out.finished else None)
            body = dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[choice]))
            if not req.include_usage:
                body.pop("usage")
            return [body]

        def usage_chunk(out) -> dict:
            return dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[], usage=usage(out)))

        return server.stream_response(rid, stream, chunks, usage_chunk if req.include_usage else None, "completions", t0)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(P.ChatCompletionRequest))
    async def chat(http_request: Request):
        t0 = time.monotonic()
        req = await server.parse(http_request, P.ChatCompletionRequest)
        server.check_model(req.model)
        server.check_alive()
        ids = await server.encode(prompts.encode_chat, req.template_messages(), req.add_generation_prompt,
                                  req.template_tools(), param="messages")
        if not ids:
            raise APIError(400, "messages produced an empty prompt", param="messages", code="invalid_prompt")
        grammar = await server.grammar(req.output_schema(), "tools" if req.tool_mode else "response_format")
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, server.max_model_len - len(ids))
        top = int(req.top_logprobs or 0)
        params = server.sampling_params(req, max_tokens, top, req.logprobs, grammar)
        rid, created = f"chatcmpl-{_request_id(http_request)}", int(time.time())
        _log_request(http_request, rid, req)
        stream = await server.add_request(rid, ids, params, "messages")
        mode = req.tool_mode

        def message(out) -> tuple[P.AssistantMessage, str | None]:
            calls = tool_calls(mode, out.text or "", req.tool_choice) if mode and out.finish_reason == "stop" else None
            if calls:
                return P.AssistantMessage(content=None, tool_calls=calls), "tool_calls"
            return P.AssistantMessage(content=out.text or ""), out.finish_reason

        if not req.stream:
            out = await server.collect(rid, stream, http_request, "chat", t0)
            if out is None:
                return Response(status_code=499)
            lp = chat_logprobs(tok, out, range(len(out.token_ids))) if req.logprobs else None
            msg, finish = message(out)
            choice = P.ChatChoice(message=msg, logprobs=lp, finish_reason=finish, stop_reason=out.stop_reason)
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
            if mode is not None:  # a tool call is sent whole, once the output is complete
                if not out.finished:
                    progress.last = out
                    return []
                msg, finish = message(out)
                progress.advance(out)
                delta = (P.DeltaMessage(tool_calls=[P.DeltaToolCall(index=i, **c.model_dump())
                                                    for i, c in enumerate(msg.tool_calls)])
                         if msg.tool_calls else P.DeltaMessage(content=msg.content))
                return [chunk(P.ChatChunkChoice(delta=delta, finish_reason=finish, stop_reason=out.stop_reason))]
            delta, new = progress.advance(out)
            if not delta and not len(new) and not out.finished:
                return []
            lp = chat_logprobs(tok, out, new) if req.logprobs else None
            done = out.finished
            return [chunk(P.ChatChunkChoice(delta=P.DeltaMessage(content=delta), logprobs=lp,
                                            finish_reason=out.finish_reason if done else None,
                                            stop_reason=out.stop_reason if done else None))]

        def usage_chunk(out) -> dict:
            return dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[], usage=usage(out)))

        return server.stream_response(rid, stream, chunks, usage_chunk if req.include_usage else None, "chat", t0)

    return app


def _request_id(http_request: Request) -> str:
    """The guard's id of this HTTP request (its X-Request-Id header); the response id and the log use it too."""
    return http_request.scope.get("state", {}).get("request_id") or P.new_id("req")


def _log_request(http_request: Request, rid: str, req) -> None:
    """The OpenAI `user` field is recorded in the server log with the request id."""
    if req.user:
        log.info("request %s from user %r", rid, req.user)
