"""From the engine's cumulative `RequestOutput` to OpenAI response pieces: usage, log-probabilities (completions and
chat shapes), tool calls of a constrained output, and the text / token deltas a stream sends.
"""
from __future__ import annotations

import json
import math
import uuid

from cpinfer.server import protocol as P

MIN_LOGPROB = -9999.0  # what a token the model gives no probability reports (JSON has no -Infinity)


def finite(lp: float | None) -> float | None:
    if lp is None:
        return None
    return lp if math.isfinite(lp) else MIN_LOGPROB


def tool_calls(mode: str, text: str, choice) -> list[P.ResponseToolCall] | None:
    """The calls in a complete constrained output: the arguments of the named function, or the array of
    {name, arguments} that `tool_choice: "required"` asks for; None when the text does not parse."""
    try:
        value = json.loads(text)
    except ValueError:
        return None

    def call(name: str, arguments: str) -> P.ResponseToolCall:
        return P.ResponseToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                                  function=P.ResponseFunctionCall(name=name, arguments=arguments))

    if mode == "named":
        return [call(choice.function.name, text)]
    if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v for v in value):
        return None
    return [call(v["name"], json.dumps(v.get("arguments", {}))) for v in value]


def token_str(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    return tokenizer.decode([token_id])


class Progress:
    """What a stream has sent so far of a cumulative `RequestOutput`: tokens, characters, and the last output."""

    def __init__(self):
        self.tokens = 0
        self.chars = 0
        self.last = None

    def advance(self, out) -> tuple[str, range]:
        """The text delta and the new token indices since the previous call; holds back a trailing partial
        UTF-8 character (decoded as U+FFFD) until the next token completes it."""
        text = out.text or ""
        end = len(text)
        if not out.finished:
            while end > self.chars and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.chars:end] if end > self.chars else ""
        new = range(self.tokens, len(out.token_ids))
        self.chars = max(self.chars, end)
        self.tokens = len(out.token_ids)
        self.last = out
        return delta, new


def usage(out) -> P.Usage:
    return P.Usage.of(len(out.prompt_token_ids), len(out.token_ids), int(out.num_cached_tokens or 0))


def completion_logprobs(tokenizer, out, idx: range, start_offset: int) -> P.CompletionLogprobs:
    tokens, lps, tops, offsets = [], [], [], []
    offset = start_offset
    for i in idx:
        tok = token_str(tokenizer, out.token_ids[i])
        tokens.append(tok)
        offsets.append(offset)
        offset += len(tok)
        lps.append(finite(out.logprobs[i]) if out.logprobs else None)
        if out.top_logprobs:
            tops.append({token_str(tokenizer, t): finite(lp) for t, lp in out.top_logprobs[i].items()})
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops if out.top_logprobs else None,
                                text_offset=offsets)


def chat_logprobs(tokenizer, out, idx: range) -> P.ChatLogprobs:
    content = []
    for i in idx:
        tok = token_str(tokenizer, out.token_ids[i])
        tops = []
        if out.top_logprobs:
            for t, lp in out.top_logprobs[i].items():
                s = token_str(tokenizer, t)
                tops.append(P.TopLogprob(token=s, logprob=finite(lp), bytes=list(s.encode())))
        content.append(P.ChatTokenLogprob(token=tok, logprob=finite(out.logprobs[i]) if out.logprobs else 0.0,
                                          bytes=list(tok.encode()), top_logprobs=tops))
    return P.ChatLogprobs(content=content)
