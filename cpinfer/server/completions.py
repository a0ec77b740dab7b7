"""`POST /v1/completions`: a prompt (text or token ids) → its completion, whole or streamed as server-sent events."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError
from cpinfer.server.outputs import Progress, completion_logprobs, usage
from cpinfer.server.state import DEFAULT_COMPLETION_TOKENS, OpenAIServer, dump, log_request, request_id


async def create_completion(server: OpenAIServer, http_request: Request):
    t0 = time.monotonic()
    req = await server.parse(http_request, P.CompletionRequest)
    server.check_model(req.model)
    server.check_alive()
    try:
        prompt = req.single_prompt()
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from None
    if isinstance(prompt, str):
        prompt = await server.encode(server.prompts.encode_text, prompt, True, param="prompt")
    schema = req.response_format.output_schema() if req.response_format is not None else None
    grammar = await server.grammar(schema, "response_format")
    top = int(req.logprobs or 0)
    params = server.sampling_params(req, req.max_tokens or DEFAULT_COMPLETION_TOKENS, top,
                                    req.logprobs is not None, grammar)
    rid, created, name, tok = f"cmpl-{request_id(http_request)}", int(time.time()), server.name, server.tokenizer
    log_request(rid, req)
    stream = await server.add_request(rid, prompt, params, "prompt")
    if not req.stream:
        out = await server.collect(rid, stream, http_request, "completions", t0)
        if out is None:
            return Response(status_code=499)
        lp = completion_logprobs(tok, out, range(len(out.token_ids)), 0) if req.logprobs is not None else None
        choice = P.CompletionChoice(text=out.text or "", logprobs=lp, finish_reason=out.finish_reason,
                                    stop_reason=out.stop_reason)
        return dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[choice], usage=usage(out)))

    def chunks(out, progress: Progress) -> list[dict]:
        if out is None:
            return []
        start = progress.chars
        delta, new = progress.advance(out)
        if not delta and not len(new) and not out.finished:
            return []
        lp = completion_logprobs(tok, out, new, start) if req.logprobs is not None else None
        choice = P.CompletionChoice(text=delta, logprobs=lp, finish_reason=out.finish_reason if out.finished
                                    else None, stop_reason=out.stop_reason if out.finished else None)
        body = dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[choice]))
        if not req.include_usage:
            body.pop("usage")
        return [body]

    def usage_chunk(out) -> dict:
        return dump(P.CompletionResponse(id=rid, created=created, model=name, choices=[], usage=usage(out)))

    return StreamingResponse(server.sse(rid, stream, chunks, usage_chunk if req.include_usage else None,
                                        "completions", t0), media_type="text/event-stream")
