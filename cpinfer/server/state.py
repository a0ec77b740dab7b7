"""What every route of `cpinfer serve` shares, kept on `app.state.server`: the engine, the server's configuration,
the prompt encoder (its thread pool), the metrics, and the helpers that parse bodies, check them, run a request
and stream it as server-sent events (docs/serving.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import Request
from pydantic import ValidationError

from cpinfer.engine.async_llm import RequestFailedError
from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError, error_body, validation_message
from cpinfer.server.metrics import ServerMetrics
from cpinfer.server.outputs import Progress
from cpinfer.server.prompts import PromptEncoder, PromptError
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

    def __post_init__(self):
        if not self.served_model_name or not self.served_model_name.strip():
            raise ValueError("served_model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given (leave it out to disable authentication)")
        if self.max_request_bytes is not None and (not isinstance(self.max_request_bytes, int)
                                                   or self.max_request_bytes < 1024):
            raise ValueError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")


class OpenAIServer:
    """Routes and helpers bound to one engine. `engine` follows the `AsyncLLM` API of docs/engine.md."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.name = config.served_model_name
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


def request_id(http_request: Request) -> str:
    """The guard's id of this HTTP request (its X-Request-Id header); the response id and the log use it too."""
    return http_request.scope.get("state", {}).get("request_id") or P.new_id("req")


def log_request(rid: str, req) -> None:
    """The OpenAI `user` field is recorded in the server log with the request id."""
    if req.user:
        log.info("request %s from user %r", rid, req.user)


def server_of(request: Request) -> OpenAIServer:
    return request.app.state.server
