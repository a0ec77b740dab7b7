"""Thinking split out of the answer for `<think>` models (`--reasoning-parser`, vLLM's names): the chat response's
`reasoning_content` holds what the model wrote between `<think>` and `</think>`, `content` what follows.

`split(text, final) -> (reasoning, rest)` keeps the streaming rule of tool_parsers.py: while the output grows both
parts only grow and a partial `</think>` waits, so a stream sends their differences.
"""
from __future__ import annotations

from typing import ClassVar

from cpinfer.server.tool_parsers import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str] = ""
    open_by_default: ClassVar[bool] = False  # the output is reasoning until </think> even without <think>

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text
        stripped = body.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START):]
        elif not final and START.startswith(stripped):
            return "", ""  # "<thi..." may still open a thought
        elif not self.open_by_default:
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):].lstrip("\n")
        return (body if final else body[:held_back(body, END)]), ""


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1: its template opens the thought in the prompt, so the output is reasoning up to `</think>`."""

    name = "deepseek_r1"
    open_by_default = True


class Qwen3Parser(ReasoningParser):
    """Qwen3: a thought is `<think>...</think>` at the start of the output; an output without one (thinking
    disabled) is all content."""

    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def reasoning_parser_for(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
