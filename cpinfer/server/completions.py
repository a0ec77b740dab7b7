"""`POST /v1/completions`: prompts (text or token ids, one or a list) → one choice per prompt and sample (`n`),
whole or streamed as server-sent events, as evaluation harnesses use it: `echo` returns the prompt's text and, with
`logprobs`, its tokens' log-probabilities (recomputed, never read from the prefix cache: a cached prefix has no
logits); `max_tokens: 0` with `echo` scores the prompt only.

Choice `index` is prompt-major: prompt i's sample j is choice i·n + j. The samples of one prompt are independent
requests with seeds seed+j; the engine prefills their shared prompt once and the others reuse its K/V from the
prefix tree (all but the last token, whose logits each needs) and copy its prompt log-probabilities.
"""
from __future__ import annotations

import dataclasses

from cpinfer.server import protocol as P
from cpinfer.server.conversation import choice_params
from cpinfer.server.errors import APIError
from cpinfer.server.outputs import Progress, completion_logprobs, echo_logprobs, usage, usage_of
from cpinfer.server.pipeline import API, Job
from cpinfer.server.state import DEFAULT_COMPLETION_TOKENS, OpenAIServer, dump


class CompletionAPI(API):
    request_model = P.CompletionRequest
    endpoint = "completions"
    id_prefix = "cmpl-"

    async def prepare(self) -> Job:
        server, req = self.server, self.req
        try:
            prompts = req.prompts()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from None
        encoded = [await server.encode(server.prompts.encode_text, p, True, param="prompt") if isinstance(p, str)
                   else p for p in prompts]
        schema = req.response_format.output_schema() if req.response_format is not None else None
        grammar = await server.grammar(schema, "response_format")
        self.score_only = req.max_tokens == 0  # echo of the prompt alone: the one sampled token is dropped
        max_tokens = 1 if self.score_only else req.max_tokens or DEFAULT_COMPLETION_TOKENS
        top = int(req.logprobs or 0)
        params = server.sampling_params(req, max_tokens, top, req.logprobs is not None, grammar)
        if req.logprobs is not None:
            server.check_logprob_payload([len(ids) * req.echo + max_tokens for ids in encoded for _ in range(req.n)],
                                         top, "logprobs")
        if req.echo and req.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=True)
        per_choice = [(ids, p) for ids in encoded for p in choice_params(params, req.n, req.seed)]
        self.texts = [p if isinstance(p, str) else None for p in prompts]
        self.offsets = [0] * len(per_choice)  # the next token's text_offset: token strings so far (as the whole
        self.echoed = [False] * len(per_choice)  # response counts)
        return Job([c[0] for c in per_choice], [c[1] for c in per_choice], "prompt")

    def response(self, outs: list) -> P.CompletionResponse:
        req = self.req
        choices = [_choice(self.server, req, i, out, self.texts[i // req.n], self.score_only)
                   for i, out in enumerate(outs)]
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.server.name, choices=choices,
                                    usage=usage_of(outs, req.n, not self.score_only))

    # ------------------------------------------------------------------ streamed
    # SSE chunks per choice; with `echo` the first carries the prompt (and its log-probabilities), and a score-only
    # request sends that one chunk with its finish reason.
    def _body(self, i: int, text: str, lp, out, last: bool) -> dict:
        choice = P.CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=out.finish_reason if last else None,
                                    stop_reason=out.stop_reason if last else None)
        chunk = dump(P.CompletionResponse(id=self.rid, created=self.created, model=self.server.name,
                                          choices=[choice]))
        if self.req.continuous_usage:
            chunk["usage"] = usage(out).model_dump()
        elif not self.req.include_usage:
            chunk.pop("usage")
        return chunk

    def _echo(self, i: int, out) -> dict:
        req = self.req
        lp = echo_logprobs(self.server.tokenizer, out, int(req.logprobs or 0), False) if req.logprobs is not None \
            else None
        if lp is not None and lp.tokens:
            self.offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
        return self._body(i, _prompt_text(self.server, out, self.texts[i // req.n]), lp, out,
                          self.score_only and out.finished)

    def events(self, i: int, out, progress: Progress) -> list[dict]:
        req = self.req
        sent = []
        if req.echo and not self.echoed[i] and (out.finished or not self.score_only):
            self.echoed[i] = True
            sent.append(self._echo(i, out))
        delta, new = progress.advance(out)
        if self.score_only or (not delta and not len(new) and not out.finished):
            return sent
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(self.server.tokenizer, out, new, self.offsets[i])
            self.offsets[i] += sum(len(t) for t in lp.tokens)
        return sent + [self._body(i, delta, lp, out, out.finished)]

    def closing(self, outs: list) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [dump(P.CompletionResponse(id=self.rid, created=self.created, model=self.server.name, choices=[],
                                          usage=usage_of(outs, self.req.n, not self.score_only)))]


def _prompt_text(server: OpenAIServer, out, given: str | None) -> str:
    """What `echo` returns: the prompt as sent, or a token-id prompt decoded."""
    if given is not None:
        return given
    return server.tokenizer.decode(out.prompt_token_ids) if server.tokenizer is not None else ""


def _choice(server: OpenAIServer, req: P.CompletionRequest, index: int, out, prompt_text: str | None,
            score_only: bool) -> P.CompletionChoice:
    tok = server.tokenizer
    text = "" if score_only else out.text or ""
    if req.echo:
        text = _prompt_text(server, out, prompt_text) + text
        lp = echo_logprobs(tok, out, int(req.logprobs or 0), not score_only) if req.logprobs is not None else None
    else:
        lp = completion_logprobs(tok, out, range(len(out.token_ids)), 0) if req.logprobs is not None else None
    return P.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=out.finish_reason,
                              stop_reason=out.stop_reason)
