"""What every route of `cpinfer serve` shares, kept on `app.state.server`: the engine, the server's configuration,
the prompt encoder (its thread pool), the metrics, the stored responses (response_store.py), and the helpers that
parse bodies, check them and build sampling params (pipeline.py runs the requests; docs/serving.md).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

from fastapi import Request
from pydantic import ValidationError

from cpinfer.engine.async_llm import RequestFailedError
from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError, validation_message
from cpinfer.server.metrics import ServerMetrics
from cpinfer.server.prompts import PromptEncoder, PromptError
from cpinfer.server.reasoning import reasoning_parser_for
from cpinfer.server.response_store import ResponseStore
from cpinfer.server.tool_parsers import tool_parser_for
from cpinfer.utils import get_logger

log = get_logger()
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI completions default for max_tokens
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/messages": "messages",
              "/v1/responses": "responses"}
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
    tool_call_parser: str | None = None  # vLLM's names (tool_parsers.py); None: recognised in the chat template
    reasoning_parser: str | None = None  # "deepseek_r1" | "qwen3" (reasoning.py); None: no reasoning split
    stream_stall_timeout_s: float = 60.0  # a streaming client that takes no data this long is disconnected
    chat_template: str | None = None  # the template text to use instead of the tokenizer's (--chat-template)
    allowed_origins: tuple[str, ...] | list[str] | None = None  # CORS origins ("*": any); None: no CORS headers
    log_requests: bool = False  # one log line per finished request (--enable-log-requests)
    responses_max_stored: int = 1000  # /v1/responses kept for previous_response_id: at most this many ...
    responses_max_stored_bytes: int = 256 << 20  # ... and this many bytes of JSON; the oldest are evicted first

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
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise ValueError("chat_template must be a non-empty template string when given")
        if self.allowed_origins is not None:
            if isinstance(self.allowed_origins, str) or not all(isinstance(o, str) and o
                                                                for o in self.allowed_origins):
                raise ValueError(f"allowed_origins must be a list of origin strings, got {self.allowed_origins!r}")
            object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        for field in ("responses_max_stored", "responses_max_stored_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field} must be an integer >= 0 (0: keep no responses), got {value!r}")
        tool_parser_for(self.tool_call_parser, None)  # ValueError naming the choices
        reasoning_parser_for(self.reasoning_parser)


class OpenAIServer:
    """Routes and helpers bound to one engine. `engine` follows the `AsyncLLM` API of docs/engine.md."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.name = config.served_model_name
        self.max_model_len = int(engine.max_model_len)
        self.max_request_bytes = config.max_request_bytes or default_max_request_bytes(self.max_model_len)
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len, config.allow_special_tokens_in_content,
                                     config.chat_template)
        template = config.chat_template or getattr(self.tokenizer, "chat_template", None)
        self.sampling_defaults = dict(getattr(engine, "generation_defaults", None) or {})  # generation_config.json
        self.tool_parser = tool_parser_for(config.tool_call_parser, template if isinstance(template, str) else None)
        self.reasoning = config.reasoning_parser  # a parser is made per choice (reasoning_parser_for)
        self.responses = ResponseStore(config.responses_max_stored, config.responses_max_stored_bytes)
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
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
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

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """A chat request's max_tokens when it sets none: the rest of the context, or the model's generation_config
        max_new_tokens when that is smaller."""
        rest = max(1, self.max_model_len - prompt_tokens)
        return min(rest, int(self.sampling_defaults.get("max_tokens", rest)))

    def sampling_params(self, req: P._SamplingRequest, max_tokens: int, top_logprobs: int, logprobs: bool,
                        grammar: str | None):
        from cpinfer import SamplingParams

        limit = int(self.engine.max_logprobs)
        if top_logprobs > limit:
            param = "logprobs" if isinstance(req, P.CompletionRequest) else "top_logprobs"
            raise APIError(400, f"{param}: at most {limit} alternatives per token (the server's --max-logprobs), "
                                f"got {top_logprobs}", param=param, code="invalid_parameter")
        vocab = int(self.engine.config.vocab_size)
        bad = [k for k in (req.logit_bias or {}) if int(k) >= vocab]
        if bad:
            raise APIError(400, f"logit_bias: token ids must be below the vocabulary size {vocab}, got {bad[:5]}",
                           param="logit_bias", code="invalid_parameter")
        kwargs = req.sampling_kwargs(max_tokens, top_logprobs, logprobs)
        for key, value in self.sampling_defaults.items():  # the model's defaults where the request set none
            if key != "max_tokens" and getattr(req, key, None) is None:  # (max_tokens: the caller's default_max_tokens)
                kwargs[key] = value
        try:
            return SamplingParams(**kwargs, grammar=grammar)
        except ValueError as exc:  # SamplingParams names the field first: "min_tokens must be ..."
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field.isidentifier() else None,
                           code="invalid_parameter") from None

    @staticmethod
    def check_logprob_payload(tokens_per_choice: list[int], top: int, param: str) -> None:
        """A 400 before any work when the response would carry more than MAX_LOGPROB_ENTRIES log-probabilities:
        every choice's tokens (echoed prompt and up to max_tokens output) × (1 + top alternatives)."""
        entries = sum(tokens_per_choice) * (1 + top)
        if entries > P.MAX_LOGPROB_ENTRIES:
            raise APIError(400, f"this request asks for {entries:,} log-probabilities ({len(tokens_per_choice)} "
                                f"choice(s), {sum(tokens_per_choice):,} tokens in all with the echoed prompt and "
                                f"max_tokens, × (1 + {top} alternatives)); at most {P.MAX_LOGPROB_ENTRIES:,} per "
                                "response: lower n, max_tokens or the number of alternatives, or split the prompts",
                           param=param, code="logprobs_too_large")

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

    async def encode(self, fn: Callable, *args, param: str):
        try:
            return await self.prompts.run(fn, *args)
        except PromptError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_prompt") from None


def dump(model) -> dict:
    body = model.model_dump()
    for choice in body.get("choices") or []:
        _plain_message(choice)
    return body


def _plain_message(choice: dict) -> dict:
    """OpenAI leaves tool_calls (and reasoning_content) out of a plain message."""
    message = choice.get("message")
    if isinstance(message, dict):
        for key in ("tool_calls", "reasoning_content"):
            if message.get(key) is None:
                message.pop(key, None)
    return choice


_CHOICES = "\x00choices\x00"
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # as FastAPI's


def json_bytes(model) -> bytes:
    """A response model as JSON, dumped and encoded one choice at a time: no single call holds the interpreter
    for the whole of a large log-prob payload (the event loop's thread gets its turns)."""
    if isinstance(model, dict):  # a body built as a dict (the Anthropic and Responses shapes)
        return _dumps(model).encode()
    choices = list(getattr(model, "choices", None) or [])
    head = model.model_copy(update={"choices": []}).model_dump()
    head = _dumps({**head, "choices": _CHOICES})  # the key keeps its place
    parts = ",".join(_dumps(_plain_message(c.model_dump())) for c in choices)
    return head.replace(_dumps(_CHOICES), f"[{parts}]", 1).encode()


def request_id(http_request: Request) -> str:
    """The guard's id of this HTTP request (its X-Request-Id header); the response id and the log use it too."""
    return http_request.scope.get("state", {}).get("request_id") or P.new_id("req")


def log_request(rid: str, req) -> None:
    """The OpenAI `user` field is recorded in the server log with the request id."""
    if req.user:
        log.info("request %s from user %r", rid, req.user)


def server_of(request: Request) -> OpenAIServer:
    return request.app.state.server
