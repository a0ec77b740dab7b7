"""Request and response bodies of the OpenAI API (completions, chat, models, errors) as pydantic models, plus the
vLLM extras cpinfer accepts (`top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`add_generation_prompt`, `skip_special_tokens`, `include_stop_str_in_output`, `/tokenize`, `/detokenize`).

Requests are strict: an int is a JSON integer and a bool a JSON boolean (no "5" or "yes"), floats are finite, and
a field cpinfer does not implement is a 400 naming it, never accepted and ignored (docs/serving.md lists them).
`sampling_kwargs` maps a request onto `SamplingParams` keyword arguments.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_LOGPROB_ENTRIES = 4_000_000  # log-probabilities one response may carry: choices × tokens × (1 + top)
MAX_STOP, MAX_STOP_CHARS = 16, 1000
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_N = 16  # samples per prompt (`n`)
MAX_CHOICES = 256  # prompts × n in one request
_INT64 = 2 ** 63
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class _Strict(BaseModel):
    """Strict types and no unknown fields: a typo or an unimplemented option is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False  # one more chunk, with empty choices, carries the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the output always follows the schema; accepted as the statement it is


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and allowed only with it")
        return self

    def output_schema(self) -> dict | None:
        """The JSON schema the output must follow, or None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"}


class _SamplingRequest(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=-1)  # vLLM: -1 or 0 = all tokens
    seed: Optional[int] = Field(default=None, ge=-_INT64, lt=_INT64)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: int = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=100)  # vLLM extra: 1 = off
    min_p: Optional[float] = Field(default=None, ge=0, le=1)  # vLLM extra
    min_tokens: Optional[int] = Field(default=None, ge=0)  # vLLM extra
    skip_special_tokens: Optional[bool] = None  # vLLM extra (default true)
    include_stop_str_in_output: bool = False  # vLLM extra: the matched stop string stays in the text
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = Field(default=None, max_length=256)  # written to the server log with the request id

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}] (samples of one prompt), got n={n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids):
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        if bias is None:
            return bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit() or len(key) > 12:
                raise ValueError(f"keys must be token ids as decimal strings, got {key[:20]!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return bias

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    def sampling_kwargs(self, max_tokens: int, top_logprobs: int, logprobs: bool) -> dict[str, Any]:
        """Keyword arguments for `SamplingParams` (OpenAI defaults: temperature 1, top_p 1)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": max(0, self.top_k or 0),
            "seed": self.seed,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "logit_bias": tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            "presence_penalty": float(self.presence_penalty or 0.0),
            "frequency_penalty": float(self.frequency_penalty or 0.0),
            "repetition_penalty": 1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            "min_p": float(self.min_p or 0.0),
            "min_tokens": int(self.min_tokens or 0),
            "skip_special_tokens": self.skip_special_tokens is not False,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        if stops:
            kwargs["stop"] = tuple(stops)
        if top_logprobs:
            kwargs["top_logprobs"] = top_logprobs
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0: with echo, score the prompt only
    logprobs: Optional[int] = Field(default=None, ge=0)  # at most the server's --max-logprobs
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix is not None:
            raise ValueError("suffix (fill-in-the-middle) is not supported; leave it out")
        return suffix

    @model_validator(mode="after")
    def _choices_and_echo(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only null or equal to n ({self.n}) is supported (cpinfer returns every "
                             f"sample; it does not rank extra candidates), got {self.best_of}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (score the prompt); send at least 1")
        if self.echo and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("echo: cannot be combined with a response_format")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of this request, in order (one string, one token list, or a list of either)."""
        p = self.prompt
        prompts = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(prompts)} prompts × n={self.n} = {len(prompts) * self.n} choices; at most "
                             f"{MAX_CHOICES} per request")
        for i, one in enumerate(prompts):
            where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            if not one:
                raise ValueError(f"{where} is empty")
            if isinstance(one, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in one):
                raise ValueError(f"{where}: a token-id prompt must be a list of integers")
        return prompts


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = Field(default=None, max_length=256)
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier reply's thought, handed to the chat template
    # what the openai SDK sends back with an earlier reply (`messages.append(reply.message)`): accepted when empty
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = Field(default=None, max_length=0)
    audio: Optional[None] = None
    function_call: Optional[None] = None

    @model_validator(mode="after")
    def _role_fields(self):
        if self.refusal:
            raise ValueError("refusal: only an empty refusal is accepted in a message")
        if (self.tool_calls is not None or self.reasoning_content is not None) and self.role != "assistant":
            raise ValueError("tool_calls / reasoning_content are only allowed on assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id is only allowed on tool messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects, as Hugging Face templates expect)."""
        import json

        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args: Any = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                          "arguments": args}})
            m["tool_calls"] = calls
        return m


class FunctionDef(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # arguments always follow `parameters` when the call is constrained

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _TOOL_NAME.match(name):
            raise ValueError("function names are 1-64 characters of a-z, A-Z, 0-9, _, . and -")
        return name


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                               "conversation", "documents", "return_dict", "continue_final_message")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0)  # at most the server's --max-logprobs
    add_generation_prompt: bool = True  # vLLM extra
    tools: Optional[list[Tool]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM extra: more variables for the chat template

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs):
        bad = [k for k in kwargs or {} if not k.isidentifier() or k in RESERVED_TEMPLATE_VARIABLES]
        if bad:
            raise ValueError(f"chat_template_kwargs: {bad[0]!r} cannot be set (names must be identifiers other "
                             f"than {', '.join(RESERVED_TEMPLATE_VARIABLES)})")
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top, info: ValidationInfo):
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top

    @model_validator(mode="after")
    def _tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: a tool call needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        if self.tool_mode is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with a required or named tool_choice")
        if self.parallel_tool_calls is not None and not self.tools:
            raise ValueError("parallel_tool_calls: only allowed with tools")
        return self

    @property
    def auto_tools(self) -> bool:
        """Tools with tool_choice "auto" (the default): the model decides; its own call format is parsed."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def tool_mode(self) -> str | None:
        """"named", "required", or None (no tool call is constrained)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else None

    def output_schema(self) -> dict | None:
        """The JSON schema the output must follow (response_format, or the tool call's arguments), or None."""
        mode = self.tool_mode
        if mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)
            return fn.parameters or {"type": "object"}
        if mode == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": t.function.name},
                                     "arguments": t.function.parameters or {"type": "object"}}}
                     for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
            return schema
        return self.response_format.output_schema() if self.response_format is not None else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


# ---------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM's field, with --reasoning-parser
    tool_calls: Optional[list[ResponseToolCall]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(ResponseToolCall):
    index: int


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cpinfer"
    root: Optional[str] = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[bool] = None  # prompt only (default true)
    add_generation_prompt: Optional[bool] = None  # messages only (default true)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and self.add_special_tokens is not None:
            raise ValueError("add_special_tokens: only with prompt (a chat template adds its own special tokens)")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise ValueError("add_generation_prompt: only with messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
