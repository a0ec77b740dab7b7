"""`POST /v1/chat/completions`: messages through the chat template → the assistant's message, whole or streamed as
server-sent events; a required or named `tool_choice` constrains the output to a call (structured.py)."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cpinfer.server import protocol as P
from cpinfer.server.errors import APIError
from cpinfer.server.outputs import Progress, chat_logprobs, tool_calls, usage
from cpinfer.server.state import OpenAIServer, dump, log_request, request_id


async def create_chat_completion(server: OpenAIServer, http_request: Request):
    t0 = time.monotonic()
    req = await server.parse(http_request, P.ChatCompletionRequest)
    server.check_model(req.model)
    server.check_alive()
    ids = await server.encode(server.prompts.encode_chat, req.template_messages(), req.add_generation_prompt,
                              req.template_tools(), param="messages")
    if not ids:
        raise APIError(400, "messages produced an empty prompt", param="messages", code="invalid_prompt")
    grammar = await server.grammar(req.output_schema(), "tools" if req.tool_mode else "response_format")
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, server.max_model_len - len(ids))
    top = int(req.top_logprobs or 0)
    params = server.sampling_params(req, max_tokens, top, req.logprobs, grammar)
    rid, created, name, tok = f"chatcmpl-{request_id(http_request)}", int(time.time()), server.name, server.tokenizer
    log_request(rid, req)
    stream = await server.add_request(rid, ids, params, "messages")
    mode = req.tool_mode

    def message(out) -> tuple[P.AssistantMessage, str | None]:
        calls = tool_calls(mode, out.text or "", req.tool_choice) if mode and out.finish_reason == "stop" else None
        if calls:
            return P.AssistantMessage(content=None, tool_calls=calls), "tool_calls"
        return P.AssistantMessage(content=out.text or ""), out.finish_reason

    if not req.stream:
        out = await server.collect(rid, stream, http_request, "chat", t0)
        if out is None:
            return Response(status_code=499)
        lp = chat_logprobs(tok, out, range(len(out.token_ids))) if req.logprobs else None
        msg, finish = message(out)
        choice = P.ChatChoice(message=msg, logprobs=lp, finish_reason=finish, stop_reason=out.stop_reason)
        return dump(P.ChatCompletionResponse(id=rid, created=created, model=name, choices=[choice],
                                              usage=usage(out)))

    def chunk(choice: P.ChatChunkChoice) -> dict:
        body = dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[choice]))
        delta = body["choices"][0]["delta"]
        body["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}  # as OpenAI sends it
        if not req.include_usage:
            body.pop("usage")
        return body

    def chunks(out, progress: Progress) -> list[dict]:
        if out is None:  # the opening chunk carries the role
            return [chunk(P.ChatChunkChoice(delta=P.DeltaMessage(role="assistant", content="")))]
        if mode is not None:  # a tool call is sent whole, once the output is complete
            if not out.finished:
                progress.last = out
                return []
            msg, finish = message(out)
            progress.advance(out)
            delta = (P.DeltaMessage(tool_calls=[P.DeltaToolCall(index=i, **c.model_dump())
                                                for i, c in enumerate(msg.tool_calls)])
                     if msg.tool_calls else P.DeltaMessage(content=msg.content))
            return [chunk(P.ChatChunkChoice(delta=delta, finish_reason=finish, stop_reason=out.stop_reason))]
        delta, new = progress.advance(out)
        if not delta and not len(new) and not out.finished:
            return []
        lp = chat_logprobs(tok, out, new) if req.logprobs else None
        done = out.finished
        return [chunk(P.ChatChunkChoice(delta=P.DeltaMessage(content=delta), logprobs=lp,
                                        finish_reason=out.finish_reason if done else None,
                                        stop_reason=out.stop_reason if done else None))]

    def usage_chunk(out) -> dict:
        return dump(P.ChatCompletionChunk(id=rid, created=created, model=name, choices=[], usage=usage(out)))

    return StreamingResponse(server.sse(rid, stream, chunks, usage_chunk if req.include_usage else None,
                                        "chat", t0), media_type="text/event-stream")
