"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API (what Claude Code and the
`anthropic` SDK speak) as a translation into a chat request (conversation.py) and of its reply back into Anthropic
content blocks: `thinking` (with a reasoning parser), `text`, `tool_use`; streamed as Anthropic's event sequence.

`usage` follows Anthropic: `input_tokens` are the prompt tokens computed anew, `cache_read_input_tokens` those
served from the prefix cache (the sharded K/V of earlier turns), `cache_creation_input_tokens` 0 (every prompt is
cached without asking; `cache_control` marks are accepted and change nothing). Errors have Anthropic's shape
(errors.py).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import Request
from pydantic import Field, field_validator, model_validator

from cpinfer.server import protocol as P
from cpinfer.server.conversation import Piece, prepare
from cpinfer.server.errors import APIError, anthropic_error_body
from cpinfer.server.outputs import Progress
from cpinfer.server.pipeline import API, Job
from cpinfer.server.state import OpenAIServer

THINKING_SWITCH = "enable_thinking"  # the chat-template variable of models with a reasoning switch (Qwen3, ...)


# ---------------------------------------------------------------------------------------------- request bodies
class CacheControl(P._Strict):
    type: Literal["ephemeral"]
    ttl: Optional[str] = None


class TextBlock(P._Strict):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[list[Any]] = Field(default=None, max_length=0)


class ToolUseBlock(P._Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(P._Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Optional[Union[str, list[TextBlock]]] = None
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(P._Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(P._Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class Message(P._Strict):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[Block], Field(min_length=1)]]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolDef(P._Strict):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return P.FunctionDef._name(name)  # the rule of OpenAI's function names


class ToolChoice(P._Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _name_iff_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: name is required with type 'tool' and allowed only with it")
        return self


class Thinking(P._Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = Field(default=None, ge=1)  # accepted; the output is bounded by max_tokens
    display: Optional[Literal["summarized", "omitted"]] = None  # omitted: thinking blocks come back empty


class Metadata(P._Strict):
    user_id: Optional[str] = Field(default=None, max_length=256)


class CountTokensRequest(P._Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Optional[Union[str, list[TextBlock]]] = None
    tools: Optional[list[ToolDef]] = Field(default=None, max_length=P.MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    cache_control: Optional[CacheControl] = None  # every prompt is cached: accepted, changes nothing


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    metadata: Optional[Metadata] = None

    @property
    def user(self) -> str | None:  # written to the server log with the request id (state.log_request)
        return self.metadata.user_id if self.metadata else None


# ---------------------------------------------------------------------------------------------- translation in
def chat_request(req: CountTokensRequest, template: str | None) -> P.ChatCompletionRequest:
    """The chat request this Anthropic request asks for (a 400 naming the field when it cannot be one)."""
    body: dict[str, Any] = {"messages": _messages(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description
                                                              else {})}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use and req.tools:
            body["parallel_tool_calls"] = False
    if req.thinking is not None and template is not None and THINKING_SWITCH in template:
        body["chat_template_kwargs"] = {THINKING_SWITCH: req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for key in ("temperature", "top_p", "top_k"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    try:
        return P.ChatCompletionRequest.model_validate(body)
    except ValueError as exc:  # a check of the chat request (stop strings, tool names, ...)
        raise APIError(400, str(exc).split("\n", 1)[-1].strip()[:600], code="invalid_request") from None


def _messages(req: CountTokensRequest) -> list[dict]:
    """System prompt and messages as chat messages: tool_use → an assistant's tool_calls, each tool_result → a tool
    message (before the rest of its user turn), thinking → the assistant's reasoning_content."""
    out: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    seen: set[str] = set()
    for m, msg in enumerate(req.messages):
        text, calls, results, thought = [], [], [], []
        for b, block in enumerate(msg.blocks()):
            where = f"messages.{m}.content.{b}"
            if block.type == "text":
                text.append(block.text)
            elif block.type in ("thinking", "redacted_thinking"):
                if msg.role != "assistant":
                    raise APIError(400, f"{where}: {block.type} blocks belong to assistant messages")
                thought.append(getattr(block, "thinking", ""))
            elif block.type == "tool_use":
                if msg.role != "assistant":
                    raise APIError(400, f"{where}: tool_use blocks belong to assistant messages")
                seen.add(block.id)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            else:  # tool_result
                if msg.role != "user":
                    raise APIError(400, f"{where}: tool_result blocks belong to user messages")
                if block.tool_use_id not in seen:
                    raise APIError(400, f"{where}: tool_result for tool_use_id {block.tool_use_id[:80]!r} has no "
                                        "tool_use block with that id in an earlier assistant message")
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        out.extend(results)
        if msg.role == "assistant":
            one: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                one["tool_calls"] = calls
            if thought:
                one["reasoning_content"] = "".join(thought)
            out.append(one)
        elif text or not results:
            out.append({"role": "user", "content": "".join(text)})
    if req.messages[-1].role == "assistant":
        raise APIError(400, f"messages.{len(req.messages) - 1}: the last message must be the user's (continuing a "
                            "prefilled assistant message is not supported)")
    return out


def template_of(server: OpenAIServer) -> str | None:
    template = server.config.chat_template or getattr(server.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------------------------------- translation out
def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
            "input": json.loads(call.arguments)}


def _stop(piece: Piece, out, stops: list[str]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if piece.finish == "tool_calls":
        return "tool_use", None
    if piece.finish == "length":
        return "max_tokens", None
    if piece.finish == "abort":
        return None, None
    if isinstance(out.stop_reason, str) and out.stop_reason in stops:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage(out) -> dict:
    cached = int(out.num_cached_tokens or 0)
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": len(out.token_ids),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class MessagesAPI(API):
    request_model = MessagesRequest
    endpoint = "messages"
    id_prefix = "msg_"
    done_line = None

    async def prepare(self) -> Job:
        chat = await prepare(self.server, chat_request(self.req, template_of(self.server)))
        self.reply = chat.replies[0]
        self.stops = list(self.req.stop_sequences or [])
        self.omit_thinking = self.req.thinking is not None and self.req.thinking.display == "omitted"
        self.started, self.block, self.index, self.last_piece = False, None, -1, None
        return chat.job

    def _message(self, content: list, out, stop: tuple[str | None, str | None]) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.server.name,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage(out)}

    def response(self, outs: list) -> dict:
        out = outs[0]
        piece = self.reply.whole(out)
        content: list[dict] = []
        if piece.reasoning:
            content.append({"type": "thinking", "thinking": "" if self.omit_thinking else piece.reasoning,
                            "signature": ""})
        if piece.content or not piece.calls:
            content.append({"type": "text", "text": piece.content})
        content += [_tool_use(c) for c in piece.calls]
        return self._message(content, out, _stop(piece, out, self.stops))

    # ------------------------------------------------------------------ streamed
    def frame(self, event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def error_event(self, err: APIError) -> dict:
        return anthropic_error_body(err.status, err.message)

    def _open(self, kind: str, block: dict) -> list[dict]:
        """Close the open block (if any other) and open a new one of `kind`."""
        events = self._close()
        self.index += 1
        self.block = kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        events = []
        if self.block == "thinking":
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self.block = None
        return events + [{"type": "content_block_stop", "index": self.index}]

    def events(self, i: int, out, progress: Progress) -> list[dict]:
        progress.advance(out)
        events = []
        if not self.started:  # with the first token: usage then knows the cached prefix
            self.started = True
            start = self._message([], out, (None, None))
            start["usage"]["output_tokens"] = 0
            events.append({"type": "message_start", "message": start})
        piece = self.reply.delta(out)
        if piece.reasoning and self.omit_thinking:
            if self.block != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        elif piece.reasoning:
            if self.block != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "thinking_delta", "thinking": piece.reasoning}})
        if piece.content:
            if self.block != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "text_delta", "text": piece.content}})
        for call in piece.calls:
            block = _tool_use(call)
            events += self._open("tool_use", {**block, "input": {}})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
            events += self._close()
        if out.finished:
            if self.index < 0:  # an empty reply still has its text block
                events += self._open("text", {"type": "text", "text": ""})
            events += self._close()
            self.last_piece = piece
        return events

    def closing(self, outs: list) -> list[dict]:
        out = outs[0]
        stop = _stop(self.last_piece, out, self.stops)
        if stop[0] is None:  # aborted (the server is stopping): no normal end
            return [anthropic_error_body(503, "the request was aborted: the server is shutting down")]
        return [{"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                 "usage": usage(out)}, {"type": "message_stop"}]


async def count_tokens(server: OpenAIServer, http_request: Request) -> dict:
    """`/v1/messages/count_tokens`: the prompt this request would be, in tokens (nothing runs)."""
    req = await server.parse(http_request, CountTokensRequest)
    server.check_model(req.model)
    chat = chat_request(req, template_of(server))
    ids = await server.encode(server.prompts.encode_chat, chat.template_messages(), True, chat.template_tools(),
                              "messages", chat.chat_template_kwargs, param="messages")
    return {"input_tokens": len(ids)}
