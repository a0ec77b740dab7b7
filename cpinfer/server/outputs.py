"""From the engine's cumulative `RequestOutput` to OpenAI response pieces: usage, log-probabilities (completions and
chat shapes; with `echo`, the prompt's own first), tool calls of a constrained output, and the text / token deltas a
stream sends.
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


def usage_of(outs: list, n: int, completion_tokens: bool = True) -> P.Usage:
    """Usage of a request's choices (prompt-major, n per prompt): each prompt's tokens and cached tokens counted
    once (its first sample's: the one that prefilled it), every choice's completion tokens."""
    firsts = outs[::n]
    done = sum(len(o.token_ids) for o in outs) if completion_tokens else 0
    return P.Usage.of(sum(len(o.prompt_token_ids) for o in firsts), done,
                      sum(int(o.num_cached_tokens or 0) for o in firsts))


def _top(tokenizer, top: dict | None) -> dict | None:
    return None if top is None else {token_str(tokenizer, t): finite(lp) for t, lp in top.items()}


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
            tops.append(_top(tokenizer, out.top_logprobs[i]))
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops if out.top_logprobs else None,
                                text_offset=offsets)


def echo_logprobs(tokenizer, out, top: int, with_output: bool) -> P.CompletionLogprobs:
    """`echo` with `logprobs`: every prompt token (the first has no log-probability: null, as OpenAI and vLLM send
    it), then the output's tokens unless the request scored the prompt only (max_tokens 0)."""
    tokens = [token_str(tokenizer, t) for t in out.prompt_token_ids]
    offsets = [0] * len(tokens)
    for i in range(1, len(tokens)):
        offsets[i] = offsets[i - 1] + len(tokens[i - 1])
    lps = [finite(lp) for lp in (out.prompt_logprobs or [None] * len(tokens))]
    tops = None
    if top:
        prompt_tops = out.prompt_top_logprobs or [None] * len(tokens)
        tops = [_top(tokenizer, t) for t in prompt_tops]
    lp = P.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)
    if with_output and out.token_ids:
        end = offsets[-1] + len(tokens[-1]) if tokens else 0
        rest = completion_logprobs(tokenizer, out, range(len(out.token_ids)), end)
        lp.tokens += rest.tokens
        lp.token_logprobs += rest.token_logprobs
        lp.text_offset += rest.text_offset
        if tops is not None:
            lp.top_logprobs += rest.top_logprobs or [None] * len(rest.tokens)
    return lp


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
