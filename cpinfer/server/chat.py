"""`POST /v1/chat/completions`: messages through the chat template → `n` assistant messages, whole or streamed as
server-sent events.

Tools: a required or named `tool_choice` constrains the output to a call (structured.py); `"auto"` lets the model
write its own format, parsed into `tool_calls` by the server's tool parser (tool_parsers.py). With a reasoning
parser (reasoning.py) the thought goes to `reasoning_content`. Streams send content and reasoning as they grow and
each call whole once its JSON closes.
"""
from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import Response

from cpinfer.server import protocol as P
from cpinfer.server.completions import choice_params
from cpinfer.server.errors import APIError
from cpinfer.server.outputs import Progress, chat_logprobs, tool_calls, usage_of
from cpinfer.server.reasoning import reasoning_parser_for
from cpinfer.server.state import OpenAIServer, dump, log_request, request_id
from cpinfer.server.tool_parsers import TOOL_PARSERS, ToolParser


class ReplyParser:
    """One choice's text → (reasoning, content, calls), and the deltas a stream has not sent yet."""

    def __init__(self, reasoning, tools: ToolParser | None, max_calls: int | None = None):
        self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls
        self.sent = [0, 0, 0]  # reasoning chars, content chars, calls

    def parse(self, text: str, final: bool) -> tuple[str, str, list]:
        if not final:
            text = text.rstrip("\ufffd")  # a partial UTF-8 character waits for its next token
        reasoning, rest = self.reasoning.split(text, final) if self.reasoning is not None else ("", text)
        content, calls = self.tools.extract(rest, final) if self.tools is not None else (rest, [])
        return reasoning, content, calls[:self.max_calls]

    def delta(self, text: str, final: bool) -> tuple[str, str, list]:
        reasoning, content, calls = self.parse(text, final)
        r, c, k = self.sent
        self.sent = [max(r, len(reasoning)), max(c, len(content)), max(k, len(calls))]
        return reasoning[r:], content[c:], calls[k:]


async def create_chat_completion(server: OpenAIServer, http_request: Request):
    t0 = time.monotonic()
    req = await server.parse(http_request, P.ChatCompletionRequest)
    server.check_model(req.model)
    server.check_alive()
    tool_parser = _tool_parser(server, req)
    ids = await server.encode(server.prompts.encode_chat, req.template_messages(), req.add_generation_prompt,
                              req.template_tools(), "messages", req.chat_template_kwargs, param="messages")
    if not ids:
        raise APIError(400, "messages produced an empty prompt", param="messages", code="invalid_prompt")
    grammar = await server.grammar(req.output_schema(), "tools" if req.tool_mode else "response_format")
    max_tokens = req.max_completion_tokens or req.max_tokens or server.default_max_tokens(len(ids))
    top = int(req.top_logprobs or 0)
    params = server.sampling_params(req, max_tokens, top, req.logprobs, grammar)
    if req.logprobs and (req.max_completion_tokens or req.max_tokens):  # the default (the rest of the context)
        server.check_logprob_payload([max_tokens] * req.n, top, "logprobs")  # is not held against a request
    if tool_parser is not None and tool_parser.special_markers and req.skip_special_tokens is None:
        params = dataclasses.replace(params, skip_special_tokens=False)  # its markers are special tokens
    rid, created = f"chatcmpl-{request_id(http_request)}", int(time.time())
    log_request(rid, req)
    per_choice = choice_params(params, req.n, req.seed)
    rids, streams = await server.add_requests(rid, [ids] * req.n, per_choice, "messages")
    reasoning = reasoning_parser_for(server.reasoning) if req.tool_mode is None else None
    one = 1 if req.parallel_tool_calls is False else None  # the model's first call only
    parsers = [ReplyParser(reasoning, tool_parser() if tool_parser else None, one) for _ in rids]
    if not req.stream:
        outs = await server.collect(rids, streams, http_request, "chat", t0)
        if outs is None:
            return Response(status_code=499)
        def build() -> P.ChatCompletionResponse:
            choices = [_choice(server, req, i, out, parsers[i]) for i, out in enumerate(outs)]
            return P.ChatCompletionResponse(id=rid, created=created, model=server.name, choices=choices,
                                            usage=usage_of(outs, req.n))
        return await server.respond(build)
    return server.stream_response(rids, _stream(server, req, rid, created, rids, streams, parsers, t0))


def _tool_parser(server: OpenAIServer, req: P.ChatCompletionRequest) -> type[ToolParser] | None:
    """The parser of the model's own calls when tool_choice is "auto"; a 400 naming the flag when there is none."""
    if not req.auto_tools:
        return None
    if server.tool_parser is None:
        raise APIError(400, "tool_choice 'auto' (the default with tools) needs the model's tool-call format, which "
                            "cpinfer does not recognise in this chat template: start the server with "
                            f"--tool-call-parser ({', '.join(TOOL_PARSERS)}), or send tool_choice 'required', "
                            "'none' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice", code="no_tool_parser")
    return server.tool_parser


def _response_calls(calls) -> list[P.ResponseToolCall]:
    return [P.ResponseToolCall(id=c.id, function=P.ResponseFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def _choice(server: OpenAIServer, req: P.ChatCompletionRequest, index: int, out, parser: ReplyParser):
    lp = chat_logprobs(server.tokenizer, out, range(len(out.token_ids))) if req.logprobs else None
    mode, finish = req.tool_mode, out.finish_reason
    if mode is not None:  # a constrained call: the whole output is its JSON
        calls = tool_calls(mode, out.text or "", req.tool_choice) if out.finish_reason == "stop" else None
        msg = (P.AssistantMessage(content=None, tool_calls=calls) if calls
               else P.AssistantMessage(content=out.text or ""))
        finish = "tool_calls" if calls else finish
    else:
        reasoning, content, parsed = parser.parse(out.text or "", final=True)
        msg = P.AssistantMessage(content=content if content or not parsed else None,
                                 reasoning_content=reasoning if parser.reasoning is not None else None,
                                 tool_calls=_response_calls(parsed) or None)
        finish = "tool_calls" if parsed and finish == "stop" else finish
    return P.ChatChoice(index=index, message=msg, logprobs=lp, finish_reason=finish, stop_reason=out.stop_reason)


def _stream(server: OpenAIServer, req: P.ChatCompletionRequest, rid: str, created: int, rids: list, streams: list,
            parsers: list[ReplyParser], t0: float):
    tok, name, mode = server.tokenizer, server.name, req.tool_mode
    called = [False] * len(rids)
    opened = [False] * len(rids)

    def chunk(choice: P.ChatChunkChoice) -> dict:
        if not opened[choice.index]:  # the role goes with a choice's first token (as vLLM sends it), never before
            opened[choice.index] = True  # prefill: clients time the first token by the first chunk
            choice.delta.role = "assistant"
        body = dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[choice]))
        delta = body["choices"][0]["delta"]
        body["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}  # as OpenAI sends it
        if not req.include_usage:
            body.pop("usage")
        return body

    def constrained(i: int, out, progress: Progress) -> list[dict]:
        """A required / named call is sent whole, once the output is complete."""
        if not out.finished:
            progress.last = out
            return []
        progress.advance(out)
        msg = _choice(server, req, i, out, parsers[i])
        delta = (P.DeltaMessage(tool_calls=[P.DeltaToolCall(index=k, **c.model_dump())
                                            for k, c in enumerate(msg.message.tool_calls)])
                 if msg.message.tool_calls else P.DeltaMessage(content=msg.message.content))
        return [chunk(P.ChatChunkChoice(index=i, delta=delta, finish_reason=msg.finish_reason,
                                        stop_reason=out.stop_reason))]

    def chunks(i: int, out, progress: Progress) -> list[dict]:
        if out is None:  # nothing before the first output
            return []
        if mode is not None:
            return constrained(i, out, progress)
        parser = parsers[i]
        _, new = progress.advance(out)
        reasoning, content, calls = parser.delta(out.text or "", final=out.finished)
        done = out.finished
        if not (reasoning or content or calls or len(new) or done):
            return []
        start = parser.sent[2] - len(calls)
        called[i] = called[i] or bool(calls)
        delta = P.DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                               tool_calls=[P.DeltaToolCall(index=start + k, id=c.id, function=P.ResponseFunctionCall(
                                   name=c.name, arguments=c.arguments)) for k, c in enumerate(calls)] or None)
        if not (reasoning or content or calls) and not done:
            delta.content = ""  # log-probabilities of tokens that add no text yet
        finish = ("tool_calls" if called[i] and out.finish_reason == "stop" else out.finish_reason) if done else None
        lp = chat_logprobs(tok, out, new) if req.logprobs else None
        return [chunk(P.ChatChunkChoice(index=i, delta=delta, logprobs=lp, finish_reason=finish,
                                        stop_reason=out.stop_reason if done else None))]

    def usage_chunk(outs: list) -> dict:
        return dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[], usage=usage_of(outs, req.n)))

    return server.sse(rids, streams, chunks, usage_chunk if req.include_usage else None, "chat", t0)
