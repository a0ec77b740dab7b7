"""The engine's output side, after each forward: sampled tokens → incremental text, stop strings and finish reasons,
log-probs (of output and prompt tokens), and the `RequestOutput` a caller gets. `LLMEngine.step()` is schedule →
run → `OutputProcessor.process`; this module knows nothing of ranks, blocks or the ring.
"""
from __future__ import annotations

import dataclasses
import time

from cpinfer.engine.request import Request, RequestOutput


class Detokenizer:
    """Incremental detokenization of one request's output: each new token decodes only the tokens since the last
    emitted text plus the few before it (the prefix and read offsets), so a step costs the same at token 10 and at
    token 10,000. Text that ends inside a multi-byte character (decoded as U+FFFD) waits for the token completing
    it; `flush` gives it as the whole decode would."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = 0  # tokens[prefix:read] decode to text already emitted: the context of the next decode
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        """Feed one token; the text it completes (often "" while a character is unfinished)."""
        self.tokens.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character at the end of the output), as the whole decode has it."""
        return self._emit(final=True) if self.read < len(self.tokens) else ""

    def _emit(self, final: bool) -> str:
        before = self._decode(self.tokens[self.prefix:self.read])
        text = self._decode(self.tokens[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(before):]


@dataclasses.dataclass
class TextState:
    """A request's text bookkeeping: its detokenizer and where stop strings may start (text after `min_tokens`)."""

    detok: Detokenizer
    protected: int = -1  # characters produced by the first min_tokens tokens (-1: not reached yet)
    searched: int = 0  # the text's length at the last stop-string search


class OutputProcessor:
    """Turns each forward's samples into request state and outputs. One per engine (driver side)."""

    def __init__(self, tokenizer, eos_token_ids, counters: dict):
        self.tokenizer = tokenizer
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.counters = counters  # the engine's: "prompt_tokens", "generation_tokens"

    # ------------------------------------------------------------------ one forward
    def process(self, scheduled, results, now: float, host: dict, failed: dict, matchers: dict):
        """Yield (request, why) for every sequence that sampled a token: why is None, or the reason this request
        alone fails (its sampling, grammar or text). Prompt log-probs and token counts of every sequence are taken."""
        samples = {r.seq: r for res in results for r in res.samples}
        for b, s in enumerate(scheduled):
            req = s.request
            if req.params.prompt_logprobs:
                collect_prompt_logprobs(req, s.start, b, results)
            if not s.is_decode:
                self.counters["prompt_tokens"] += len(s.tokens)
                if s.sample:  # the prompt's last chunk: count the whole prompt, cached tokens too (vLLM's count)
                    self.counters["request_prompt_tokens"] += len(req.prompt)
            if not s.sample:
                continue
            if b not in samples:
                raise RuntimeError(f"no rank returned a sample for request {req.request_id} (this is a bug)")
            why = failed.get(req.request_id) or samples[b].error
            if why is None:
                try:
                    if s.draft is None:
                        self.take_token(req, samples[b], now, host, matchers.get(req.request_id))
                    else:
                        self.take_verified(req, len(s.draft), samples[b], now, host, matchers.get(req.request_id))
                except Exception as exc:  # noqa: BLE001 - decoding / grammar of this request only
                    why = f"{type(exc).__name__}: {exc}"
            yield req, why

    def take_verified(self, req: Request, drafted: int, res, now: float, host: dict, matcher=None) -> None:
        """A verify step's tokens (the accepted drafts, then the target's own), one by one as plain decoding would
        take them: the first that ends the output (stop token or string, max_tokens) ends it and the rest is
        dropped. The request's and the engine's speculation counters follow."""
        emitted = [(t, lp, top) for t, lp, top in res.extra] + [(res.token, res.logprob, res.top)]
        first, taken = len(req.out), 0
        for token, lp, top in emitted:
            self.take_token(req, _Token(token, lp, top), now, host, matcher)
            taken += 1
            if req.finish_reason is not None:
                break
        accepted = len(res.extra)
        if req.metrics["steps"]:  # this forward's entry: what it drafted, accepted and emitted
            req.metrics["steps"][-1]["spec"] = {"drafted": drafted, "accepted": accepted, "emitted": taken,
                                                "first": first}  # the output index of its first emitted token
        if req.spec is not None:
            req.spec.record(drafted, accepted, taken)
            req.metrics["spec"] = req.spec.metrics()
        c = self.counters.get("spec")
        if c:
            c["num_drafts"] += 1
            c["num_draft_tokens"] += drafted
            c["num_accepted_tokens"] += accepted
            c["num_emitted_tokens"] += taken
            for i in range(min(accepted, len(c["accepted_per_pos"]))):
                c["accepted_per_pos"][i] += 1

    def take_token(self, req: Request, res, now: float, host: dict, matcher=None) -> None:
        """Append a sampled token (with its log-probs and timings), extend the text, and set the finish reason
        when it ends the output."""
        token = res.token
        if req.out:
            req.metrics["ttit_s"].append(now - req.t_last)
        else:
            req.metrics["ttft_s"] = now - req.arrival
            req.metrics["first_token_time"] = now
        req.t_last = now
        req.out.append(token)
        if matcher is not None:
            matcher.consume(token)
        req.logprobs.append(res.logprob)
        if req.params.top_logprobs:
            req.top_logprobs.append(dict(res.top))
        self.counters["generation_tokens"] += 1
        p = req.params
        ending = self._ending_token(req, token)
        last = len(req.out) >= p.min_tokens and (ending is not None or len(req.out) >= p.max_tokens
                                                 or (matcher is not None and matcher.done))
        if self.tokenizer is not None:
            self._extend_text(req, token, ending, last, host)
        if len(req.out) < p.min_tokens:  # before min_tokens (vLLM) nothing ends it: min_tokens <= max_tokens
            return
        if p.stop and self._stop_string(req):
            req.finish_reason = "stop"
        elif ending is not None:
            req.finish_reason, req.stop_reason = "stop", None if ending is _EOS else ending
        elif matcher is not None and matcher.done:
            req.finish_reason = "stop"
        elif len(req.out) >= p.max_tokens:
            req.finish_reason = "length"

    def _ending_token(self, req: Request, token: int):
        """What this token ends the output with: None (nothing), a stop token id, or _EOS."""
        p = req.params
        if len(req.out) < p.min_tokens:
            return None
        if not p.ignore_eos and token in self.eos:
            return _EOS
        if token in p.stop_token_ids:
            return token
        return None

    # ------------------------------------------------------------------ text
    def _state(self, req: Request) -> TextState:
        if req.text_state is None:
            req.text_state = TextState(Detokenizer(self.tokenizer, req.params.skip_special_tokens))
        return req.text_state

    def _extend_text(self, req: Request, token: int, ending, last: bool, host: dict) -> None:
        """Detokenize the new token (an ending EOS / stop token's own text is left out unless the request asks to
        include it; the last token flushes what waits for more bytes), and note where the text after the first
        `min_tokens` tokens starts."""
        st = self._state(req)
        t0 = time.perf_counter()
        if ending is None or req.params.include_stop_str_in_output:
            req.text += st.detok.add(token)
        if last:
            req.text += st.detok.flush()
        host["detokenize_s"] = host.get("detokenize_s", 0.0) + time.perf_counter() - t0
        if st.protected < 0 and len(req.out) >= req.params.min_tokens:
            st.protected = st.searched = 0 if req.params.min_tokens == 0 else len(req.text)

    def _stop_string(self, req: Request) -> bool:
        """Find the earliest stop string in the text after the first min_tokens tokens, only where the new text
        could complete one; cut the text there (after it, with include_stop_str_in_output)."""
        st = self._state(req)
        p = req.params
        longest = max(len(s) for s in p.stop)
        start = max(st.protected, st.searched - longest + 1)
        st.searched = len(req.text)
        hits = [(i, s) for i, s in ((req.text.find(s, start), s) for s in p.stop) if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        req.text = req.text[:i + len(s)] if p.include_stop_str_in_output else req.text[:i]
        req.stop_reason = s
        return True

    def visible_text(self, req: Request) -> str:
        """The text a stream may send now: all of it once finished; before, without a tail that could still grow
        into a stop string (sent text is never taken back, so a streamed answer equals the non-streamed one)."""
        p = req.params
        st = req.text_state
        if req.finish_reason is not None or not p.stop or st is None or st.protected < 0:
            return req.text
        text = req.text
        hold = 0
        for s in p.stop:
            for k in range(min(len(s) - 1, len(text) - st.protected), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    # ------------------------------------------------------------------ outputs
    def output(self, req: Request) -> RequestOutput:
        finished = req.finish_reason is not None
        req.metrics["arrival_time"] = req.arrival
        return RequestOutput(
            req.request_id, req.prompt, list(req.out), self.visible_text(req) if self.tokenizer is not None else None,
            list(req.logprobs) if req.params.logprobs else None, req.prompt_lp, max(req.num_cached, 0),
            req.finish_reason, req.metrics, list(req.top_logprobs) if req.params.top_logprobs else None,
            finished, req.stop_reason, prompt_top_logprobs=req.prompt_top_lp)


_EOS = object()  # an ending by EOS: finish reason "stop" with no stop reason


@dataclasses.dataclass(frozen=True)
class _Token:
    """One emitted token of a verify step, shaped as the SampleResult fields take_token reads."""

    token: int
    logprob: float
    top: tuple


def collect_prompt_logprobs(req: Request, start: int, b: int, results) -> None:
    """Each rank's log-probabilities of the prompt positions it held for sequence b of the forward (and their
    top-k, when asked); `start` is the position of the forward's first new token of this request."""
    if req.prompt_lp is None:
        req.prompt_lp = [None] * len(req.prompt)
        if req.params.top_logprobs:
            req.prompt_top_lp = [None] * len(req.prompt)
    for res in results:
        if b not in res.prompt_lp:
            continue
        offsets, values, *top = res.prompt_lp[b]
        for i, (o, v) in enumerate(zip(offsets.tolist(), values.tolist())):
            target = start + o + 1
            if target < len(req.prompt):
                req.prompt_lp[target] = v
                if top and req.prompt_top_lp is not None:
                    req.prompt_top_lp[target] = dict(zip(top[0][i].tolist(), top[1][i].tolist()))
