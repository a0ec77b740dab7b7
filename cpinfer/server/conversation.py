"""A conversation through the chat template, for every API that speaks in messages (chat, Anthropic messages,
Responses): the prompt ids and sampling params of a `ChatCompletionRequest` (each API translates its own request
into one), and each choice's reply read back as thought, text and tool calls, whole or as stream deltas.

Tools: a required or named `tool_choice` constrains the output to a call (structured.py); `"auto"` lets the model
write its own format, parsed by the server's tool parser (tool_parsers.py). With a reasoning parser (reasoning.py)
the thought is split from the text. While the output grows, thought and text only grow and each call arrives whole
once its JSON closes.
"""
from __future__ import annotations

import dataclasses

from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError
from cpinfer.server.outputs import tool_calls
from cpinfer.server.pipeline import Job
from cpinfer.server.reasoning import reasoning_parser_for
from cpinfer.server.state import OpenAIServer
from cpinfer.server.tool_parsers import TOOL_PARSERS, Call, ToolParser


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


@dataclasses.dataclass
class Piece:
    """What a reply holds (whole) or adds (a stream delta): thought, text, tool calls (`first` = the index of
    calls[0] among the reply's calls), and `finish` once the output ended ("tool_calls" when it called and stopped)."""

    reasoning: str
    content: str
    calls: list[Call]
    first: int = 0
    finish: str | None = None


class Reply:
    """One choice's reply: its output text read as a `Piece`, whole (`whole`) or as stream deltas (`delta`).
    A constrained call (tool_choice required / named) is its whole output's JSON, known only at the end."""

    def __init__(self, req: P.ChatCompletionRequest, reasoning: str | None, tools: type[ToolParser] | None):
        self.mode, self.choice = req.tool_mode, req.tool_choice
        one = 1 if req.parallel_tool_calls is False else None  # the model's first call only
        thought = reasoning_parser_for(reasoning) if self.mode is None else None
        self.parser = ReplyParser(thought, tools() if tools else None, one)
        self.called = False

    @property
    def has_reasoning(self) -> bool:
        return self.parser.reasoning is not None

    def whole(self, out) -> Piece:
        finish = out.finish_reason
        if self.mode is not None:
            found = tool_calls(self.mode, out.text or "", self.choice) if finish == "stop" else None
            if not found:
                return Piece("", out.text or "", [], finish=finish)
            calls = [Call(c.function.name, c.function.arguments, c.id) for c in found]
            return Piece("", "", calls, finish="tool_calls")
        reasoning, content, calls = self.parser.parse(out.text or "", final=True)
        return Piece(reasoning, content, calls, finish="tool_calls" if calls and finish == "stop" else finish)

    def delta(self, out) -> Piece:
        """What this output adds since the last call; a constrained reply comes whole with the last output."""
        if self.mode is not None:
            return self.whole(out) if out.finished else Piece("", "", [])
        reasoning, content, calls = self.parser.delta(out.text or "", final=out.finished)
        self.called = self.called or bool(calls)
        finish = None
        if out.finished:
            finish = "tool_calls" if self.called and out.finish_reason == "stop" else out.finish_reason
        return Piece(reasoning, content, calls, self.parser.sent[2] - len(calls), finish)


@dataclasses.dataclass
class ChatJob:
    """A chat request ready for the engine: the job and one `Reply` per choice."""

    job: Job
    replies: list[Reply]
    prompt_tokens: int


async def prepare(server: OpenAIServer, req: P.ChatCompletionRequest, param: str = "messages") -> ChatJob:
    """Template → prompt ids, the output grammar, `SamplingParams` (n per request; seeds seed + j)."""
    tools = tool_parser(server, req)
    ids = await server.encode(server.prompts.encode_chat, req.template_messages(), req.add_generation_prompt,
                              req.template_tools(), param, req.chat_template_kwargs, param=param)
    if not ids:
        raise APIError(400, "messages produced an empty prompt", param=param, code="invalid_prompt")
    grammar = await server.grammar(req.output_schema(), "tools" if req.tool_mode else "response_format")
    max_tokens = req.max_completion_tokens or req.max_tokens or server.default_max_tokens(len(ids))
    top = int(req.top_logprobs or 0)
    params = server.sampling_params(req, max_tokens, top, req.logprobs, grammar)
    if req.logprobs and (req.max_completion_tokens or req.max_tokens):  # the default (the rest of the context)
        server.check_logprob_payload([max_tokens] * req.n, top, "logprobs")  # is not held against a request
    if tools is not None and tools.special_markers and req.skip_special_tokens is None:
        params = dataclasses.replace(params, skip_special_tokens=False)  # its markers are special tokens
    per_choice = choice_params(params, req.n, req.seed)
    replies = [Reply(req, server.reasoning, tools) for _ in per_choice]
    return ChatJob(Job([ids] * req.n, per_choice, param), replies, len(ids))


def choice_params(params, n: int, seed: int | None) -> list:
    """n copies of a request's SamplingParams; with a seed, sample j gets seed + j (independent, reproducible)."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=None if seed is None else (seed + j) % (2 ** 63)) for j in range(n)]


def tool_parser(server: OpenAIServer, req: P.ChatCompletionRequest) -> type[ToolParser] | None:
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
