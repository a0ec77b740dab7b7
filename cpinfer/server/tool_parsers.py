"""A model's own tool-call format → OpenAI `tool_calls`, for `tool_choice: "auto"`: one parser class per format behind
a registry keyed by vLLM's `--tool-call-parser` names, chosen by that flag or recognised in the chat template.

Every parser maps the output text so far to (content, calls) with `extract(text, final)`. While the output grows
(`final` False) content never shrinks and never holds a partial marker or an unfinished call, and calls only grow,
so a stream sends the difference each time: content deltas as text comes, each call whole once its JSON closes.
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import string
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str


def held_back(text: str, marker: str) -> int:
    """The end of the part of `text` that cannot be the start of `marker` (a proper prefix of it at the end waits)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _as_call(value, args_keys: tuple[str, ...], make_id) -> Call | None:
    """{"name": str, <args key>: object} → a Call (arguments re-serialized as JSON text); anything else → None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = next((value[k] for k in args_keys if k in value), {})
    if isinstance(args, str):  # some models emit the arguments already as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(value["name"], json.dumps(args, ensure_ascii=False), make_id())


class ToolParser:
    """Base: `extract(text, final) -> (content, calls)`. `special_markers`: the markers are special tokens, so the
    output text must keep special tokens (the engine still leaves out the token that ends the output)."""

    name: ClassVar[str] = ""
    special_markers: ClassVar[bool] = False
    template_hints: ClassVar[tuple[str, ...]] = ()  # strings in a chat template that name this format

    def __init__(self):
        self._ids: list[str] = []  # a call keeps its id from one extract to the next (streams send it once)

    def _id(self, k: int) -> str:
        while len(self._ids) <= k:
            self._ids.append(self.new_id())
        return self._ids[k]

    def new_id(self) -> str:
        return _call_id()

    def extract(self, text: str, final: bool) -> tuple[str, list[Call]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, with
    content around them. A block whose JSON is not a call stays in the content as written."""

    name = "hermes"
    template_hints = ("<tool_call>",)
    START, END = "<tool_call>", "</tool_call>"

    def extract(self, text: str, final: bool) -> tuple[str, list[Call]]:
        content, calls, at = [], [], 0
        while True:
            start = text.find(self.START, at)
            if start < 0:
                tail = text[at:]
                content.append(tail if final else tail[:held_back(tail, self.START)])
                break
            content.append(text[at:start])
            end = text.find(self.END, start)
            body = text[start + len(self.START):end if end >= 0 else len(text)]
            if end < 0 and not final:  # an unfinished call: nothing after it is known yet
                break
            call = self._parse(body, len(calls))
            if call is not None:
                calls.append(call)
            else:
                content.append(text[start:end + len(self.END) if end >= 0 else len(text)])
            if end < 0:
                break
            at = end + len(self.END)
        return "".join(content), calls

    def _parse(self, body: str, k: int) -> Call | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return _as_call(value, ("arguments", "parameters"), lambda: self._id(k))


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calls: an output that starts (optionally after `<|python_tag|>`) with
    `{"name": ..., "parameters": {...}}`, several separated by `;`. Any other output is content."""

    name = "llama3_json"
    special_markers = True
    template_hints = ("<|python_tag|>", '"parameters": dictionary of argument name and its value')
    TAG = "<|python_tag|>"

    def extract(self, text: str, final: bool) -> tuple[str, list[Call]]:
        body = text.lstrip()
        if not final and (not body or self.TAG.startswith(body)):
            return "", []  # it may still become a call
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                break
            call = _as_call(value, ("parameters", "arguments"), lambda: self._id(len(calls)))
            if call is None:
                break
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        rest = body[at:]
        if not final:
            return "", calls
        if not calls:
            return text, []
        return rest, calls


class MistralParser(ToolParser):
    """Mistral: content, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} (tokenizer v3-v7), or
    `[TOOL_CALLS]name[ARGS]{...}` per call (v11+). Call ids are 9 letters and digits, as Mistral's templates
    require."""

    name = "mistral"
    special_markers = True
    template_hints = ("[TOOL_CALLS]",)
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _ALNUM = string.ascii_letters + string.digits

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))

    def extract(self, text: str, final: bool) -> tuple[str, list[Call]]:
        start = text.find(self.MARK)
        if start < 0:
            return (text if final else text[:held_back(text, self.MARK)]), []
        content, calls = text[:start], []
        pieces = text[start:].split(self.MARK)[1:]
        decoder = json.JSONDecoder()
        for i, piece in enumerate(pieces):
            piece = piece.strip()
            last = i == len(pieces) - 1
            if self.ARGS in piece:  # name[ARGS]{...}
                name, _, args = piece.partition(self.ARGS)
                try:
                    value, _ = decoder.raw_decode(args.strip())
                except ValueError:
                    if last and not final:
                        break
                    content += self.MARK + piece
                    continue
                call = _as_call({"name": name.strip(), "arguments": value}, ("arguments",),
                                lambda: self._id(len(calls)))
                if call is not None:
                    calls.append(call)
                continue
            try:
                value, _ = decoder.raw_decode(piece)
            except ValueError:
                if last and not final:
                    break
                content += self.MARK + piece
                continue
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = _as_call(item, ("arguments", "parameters"), lambda: self._id(len(calls)))
                if call is not None:
                    calls.append(call)
        return content, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser_for(name: str | None, chat_template: str | None) -> type[ToolParser] | None:
    """The parser named (ValueError listing the names if unknown), else the one whose markers the chat template
    uses, else None."""
    if name is not None:
        if name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[name]
    for parser in TOOL_PARSERS.values():
        if chat_template and any(h in chat_template for h in parser.template_hints):
            return parser
    return None
