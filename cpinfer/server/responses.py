"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API (what Codex CLI and the
OpenAI Agents SDK default to) as a translation into a chat request (conversation.py) and of its reply back into
output items: `reasoning` (with a reasoning parser), `message`, `function_call`; streamed as the Responses events.

`previous_response_id`: a stored response (`store`, the default) keeps its conversation on the server
(response_store.py, bounded, oldest evicted first), so the next turn sends only its new items; that turn's prompt
extends the stored one and its K/V is found in the prefix tree (`usage.input_tokens_details.cached_tokens`).
`instructions` hold for their own request only (as OpenAI's: not carried to the next turn).
"""
from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import Request
from pydantic import Field, field_validator, model_validator

from cpinfer.server import protocol as P
from cpinfer.server.conversation import Piece, prepare
from cpinfer.server.errors import APIError
from cpinfer.server.messages import THINKING_SWITCH, template_of
from cpinfer.server.outputs import Progress
from cpinfer.server.pipeline import API, Job
from cpinfer.server.state import OpenAIServer, server_of


# ---------------------------------------------------------------------------------------------- request bodies
class InputText(P._Strict):
    type: Literal["input_text"]
    text: str


class OutputText(P._Strict):
    type: Literal["output_text"]
    text: str
    annotations: Optional[list[Any]] = Field(default=None, max_length=0)
    logprobs: Optional[list[Any]] = None


Part = Annotated[Union[InputText, OutputText], Field(discriminator="type")]


class MessageItem(P._Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(P._Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(P._Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(P._Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(P._Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(P._Strict):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[SummaryText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[None] = None
    status: Optional[str] = None


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


class FunctionTool(P._Strict):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return P.FunctionDef._name(name)


class FunctionChoice(P._Strict):
    type: Literal["function"]
    name: str


class Reasoning(P._Strict):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None


class TextFormat(P._Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(P._Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted; the model decides its length


class StreamOptions(P._Strict):
    include_obfuscation: Optional[bool] = None  # accepted; events carry no obfuscation padding


class ResponsesRequest(P._Strict):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[FunctionTool]] = Field(default=None, max_length=P.MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    store: bool = True
    previous_response_id: Optional[str] = Field(default=None, max_length=256)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    reasoning: Optional[Reasoning] = None
    text: Optional[TextConfig] = None
    metadata: Optional[dict[str, str]] = Field(default=None, max_length=16)
    user: Optional[str] = Field(default=None, max_length=256)
    truncation: Optional[Literal["disabled"]] = None  # the context is never cut: an over-long prompt is a 400
    include: Optional[list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]]] = None
    prompt_cache_key: Optional[str] = Field(default=None, max_length=256)  # every prompt is cached: accepted
    safety_identifier: Optional[str] = Field(default=None, max_length=256)
    service_tier: Optional[Literal["auto", "default"]] = None
    background: Optional[Literal[False]] = None

    @field_validator("input")
    @classmethod
    def _items(cls, value):
        if isinstance(value, str):
            return value
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message")
            if kind not in ITEMS:
                raise ValueError(f"input.{i}: unsupported item type {str(kind)[:40]!r} (supported: "
                                 f"{', '.join(ITEMS)})")
            try:
                items.append(ITEMS[kind].model_validate(item))
            except ValueError as exc:
                first = exc.errors()[0] if hasattr(exc, "errors") else {}
                where = ".".join(str(x) for x in first.get("loc", ()))
                raise ValueError(f"input.{i}{'.' + where if where else ''}: "
                                 f"{first.get('msg', str(exc))}") from None
        return items

    @model_validator(mode="after")
    def _checks(self):
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: give at least one item (or a previous_response_id to continue)")
        return self


# ---------------------------------------------------------------------------------------------- translation in
def _history(server: OpenAIServer, req: ResponsesRequest) -> list[dict]:
    """The stored conversation `previous_response_id` continues (a 404 that says why it is not there)."""
    if req.previous_response_id is None:
        return []
    stored = server.responses.get(req.previous_response_id)
    if stored is None:
        raise APIError(404, _missing(server, req.previous_response_id), param="previous_response_id",
                       code="previous_response_not_found")
    return [dict(m) for m in stored.messages]


def _missing(server: OpenAIServer, response_id: str) -> str:
    if server.responses.was_evicted(response_id):
        return (f"response {response_id!r} was evicted: the server keeps the newest {server.responses.max_count} "
                f"responses within {server.responses.max_bytes >> 20} MiB (--responses-max-stored, "
                "--responses-max-stored-mib); send the whole conversation as input instead")
    return (f"no response {response_id[:80]!r} is stored on this server (never created here, created with "
            "store=false, or deleted)")


def _conversation(history: list[dict], req: ResponsesRequest) -> list[dict]:
    """The stored history plus this request's input items as chat messages: function_call items join an assistant
    message's tool_calls, function_call_output items become tool messages, reasoning items the next assistant
    message's reasoning_content."""
    out = list(history)
    known = {c["id"] for m in history for c in m.get("tool_calls") or []}
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    thought: list[str] = []

    def assistant() -> dict:  # this input's assistant message being built (never the stored reply)
        if len(out) == len(history) or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        if item.type == "reasoning":
            thought += [c.text for c in item.content or []] or [s.text for s in item.summary]
            continue
        if item.type == "message" and item.role == "assistant":
            msg = assistant()
            msg["content"] += item.text()
        elif item.type == "function_call":
            msg = assistant()
            known.add(item.call_id)
            msg.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
        elif item.type == "function_call_output":
            if item.call_id not in known:
                raise APIError(400, f"input.{i}: function_call_output for call_id {item.call_id[:80]!r} has no "
                                    "function_call with that call_id before it (in input or the previous response)",
                               param="input")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            continue
        else:
            out.append({"role": item.role, "content": item.text()})
            continue
        if thought:
            msg["reasoning_content"] = "".join(thought)
            thought = []
    return out


def chat_request(req: ResponsesRequest, messages: list[dict], template: str | None) -> P.ChatCompletionRequest:
    body: dict[str, Any] = {"messages": ([{"role": "system", "content": req.instructions}] if req.instructions
                                         else []) + messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str) else
                               {"type": "function", "function": {"name": req.tool_choice.name}})
    if req.parallel_tool_calls is not None and req.tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {}}})
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and template is not None and THINKING_SWITCH in template:
        body["chat_template_kwargs"] = {THINKING_SWITCH: effort != "none"}
    try:
        return P.ChatCompletionRequest.model_validate(body)
    except ValueError as exc:
        raise APIError(400, str(exc).split("\n", 1)[-1].strip()[:600], code="invalid_request") from None


# ---------------------------------------------------------------------------------------------- translation out
def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _call_item(item_id: str, call, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def usage(out) -> dict:
    prompt, done, cached = len(out.prompt_token_ids), len(out.token_ids), int(out.num_cached_tokens or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": done,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + done}


class ResponsesAPI(API):
    request_model = ResponsesRequest
    endpoint = "responses"
    id_prefix = "resp_"
    done_line = None

    async def prepare(self) -> Job:
        req = self.req
        self.messages = _conversation(_history(self.server, req), req)
        chat = await prepare(self.server, chat_request(req, self.messages, template_of(self.server)), "input")
        self.reply = chat.replies[0]
        self.seq, self.began = 0, False
        self.items, self.open = [], None  # the stream's finished output items, the one being written
        self.body = None
        return chat.job

    def _body(self, status: str, out=None, output: list | None = None) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        choice = req.tool_choice
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.server.name, "output": output or [], "instructions": req.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "tool_choice": "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id":
                req.previous_response_id, "store": req.store, "max_output_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "metadata": req.metadata or {},
                "reasoning": req.reasoning.model_dump() if req.reasoning else None, "error": None,
                "incomplete_details": incomplete, "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": usage(out) if out is not None else None}

    def _items(self, piece: Piece) -> list[dict]:
        items = []
        if piece.reasoning:
            items.append(_reasoning_item(_id("rs"), piece.reasoning))
        if piece.content or not piece.calls:
            items.append(_message_item(_id("msg"), piece.content))
        return items + [_call_item(_id("fc"), c) for c in piece.calls]

    def finished(self, outs: list) -> None:
        """The response's body; stored with its conversation (the reply as the assistant's message) unless
        store is false."""
        out = outs[0]
        piece = self.reply.whole(out)
        status = "incomplete" if out.finish_reason == "length" else "completed"
        self.body = self._body(status, out, self.items if self.streaming else self._items(piece))
        if self.req.store:
            reply: dict[str, Any] = {"role": "assistant", "content": piece.content}
            if piece.calls:
                reply["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": c.arguments}} for c in piece.calls]
            if piece.reasoning:
                reply["reasoning_content"] = piece.reasoning
            self.server.responses.put(self.rid, self.body, [*self.messages, reply])

    def response(self, outs: list) -> dict:
        return self.body

    # ------------------------------------------------------------------ streamed
    def frame(self, event: dict) -> str:
        event["sequence_number"] = self.seq
        self.seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def error_event(self, err: APIError) -> dict:
        return {"type": "error", "code": err.code, "message": err.message, "param": err.param}

    def _start(self, kind: str, item: dict) -> list[dict]:
        events = self._finish()
        self.open = (kind, item, [])
        index = len(self.items)
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        if kind == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []}})
        return events

    def _finish(self) -> list[dict]:
        """Close the item being written: its done events, then it joins the output."""
        if self.open is None:
            return []
        kind, item, parts = self.open
        self.open = None
        index, text, where = len(self.items), "".join(parts), {"item_id": item["id"], "output_index": len(self.items)}
        if kind == "message":
            done = _message_item(item["id"], text)
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": text,
                       "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0,
                       "part": done["content"][0]}]
        else:
            done = _reasoning_item(item["id"], text)
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}]
        self.items.append(done)
        return events + [{"type": "response.output_item.done", "output_index": index, "item": done}]

    def _write(self, kind: str, text: str, item_id: str) -> dict:
        self.open[2].append(text)
        where = {"item_id": item_id, "output_index": len(self.items), "content_index": 0}
        if kind == "message":
            return {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}
        return {"type": "response.reasoning_text.delta", **where, "delta": text}

    def events(self, i: int, out, progress: Progress) -> list[dict]:
        progress.advance(out)
        events = []
        if not self.began:  # with the first token (as the chat stream's first chunk)
            self.began = True
            opening = self._body("in_progress")
            events += [{"type": "response.created", "response": opening},
                       {"type": "response.in_progress", "response": opening}]
        piece = self.reply.delta(out)
        for kind, text, prefix in (("reasoning", piece.reasoning, "rs"), ("message", piece.content, "msg")):
            if not text:
                continue
            if self.open is None or self.open[0] != kind:
                item = ({"id": _id(prefix), "type": "reasoning", "summary": [], "content": [], "status": None}
                        if kind == "reasoning" else _message_item(_id(prefix), "", "in_progress"))
                events += self._start(kind, item)
            events.append(self._write(kind, text, self.open[1]["id"]))
        for call in piece.calls:
            events += self._finish()
            index, item_id = len(self.items), _id("fc")
            done = _call_item(item_id, call)
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": _call_item(item_id, call, "in_progress")},
                       {"type": "response.function_call_arguments.delta", "item_id": item_id,
                        "output_index": index, "delta": call.arguments},
                       {"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": index,
                        "arguments": call.arguments, "name": call.name},
                       {"type": "response.output_item.done", "output_index": index, "item": done}]
            self.items.append(done)
        if out.finished:
            if not self.items and self.open is None:  # an empty reply still has its message
                events += self._start("message", _message_item(_id("msg"), "", "in_progress"))
            events += self._finish()
        return events

    def closing(self, outs: list) -> list[dict]:
        kind = "response.incomplete" if self.body["status"] == "incomplete" else "response.completed"
        return [{"type": kind, "response": self.body}]


# ---------------------------------------------------------------------------------------------- stored responses
def _stored(request: Request, response_id: str):
    server = server_of(request)
    stored = server.responses.get(response_id)
    if stored is None:
        raise APIError(404, _missing(server, response_id), param="response_id", code="response_not_found")
    return server, stored


async def get_response(request: Request, response_id: str) -> dict:
    return _stored(request, response_id)[1].body


async def delete_response(request: Request, response_id: str) -> dict:
    server, _ = _stored(request, response_id)
    server.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}

