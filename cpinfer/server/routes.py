"""The routes of `cpinfer serve`, one module-level function each on an `APIRouter`: health, metrics, models,
tokenize / detokenize, and the generation routes, each the pipeline (pipeline.py) run with its API's translation
(`completions.py`, `chat.py`, `messages.py` for Anthropic's Messages API, `responses.py` for OpenAI's Responses).
Shared state is `request.app.state.server` (`state.OpenAIServer`).
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cpinfer.server import protocol as P
from cpinfer.server.chat import ChatAPI
from cpinfer.server.completions import CompletionAPI
from cpinfer.server.errors import APIError, error_response
from cpinfer.server.messages import CountTokensRequest, MessagesAPI, MessagesRequest, count_tokens
from cpinfer.server.metrics import CONTENT_TYPE
from cpinfer.server.pipeline import run
from cpinfer.server.responses import ResponsesAPI, ResponsesRequest, delete_response, get_response
from cpinfer.server.state import DEAD_MESSAGE, dump, server_of

router = APIRouter()


def body_schema(model: type) -> dict:
    """`openapi_extra` declaring a route's JSON body (bodies are parsed by hand, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


@router.get("/health")
async def health(request: Request):
    if server_of(request).engine.errored:
        return error_response(503, DEAD_MESSAGE, code="engine_dead")
    return Response(status_code=200)


@router.get("/version")
async def version():
    from cpinfer import __version__

    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request):
    body = await asyncio.to_thread(server_of(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE)


def _card(request: Request) -> P.ModelCard:
    server = server_of(request)
    name = server.config.served_model_name
    return P.ModelCard(id=name, root=name, max_model_len=server.max_model_len)


@router.get("/v1/models")
async def models(request: Request):
    return dump(P.ModelList(data=[_card(request)]))


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    name = server_of(request).config.served_model_name
    if model_id != name:
        raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{name}'",
                       param="model", code="model_not_found")
    return dump(_card(request))


@router.post("/tokenize", openapi_extra=body_schema(P.TokenizeRequest))
async def tokenize(request: Request):
    server = server_of(request)
    req = await server.parse(request, P.TokenizeRequest)
    server.check_model(req.model)
    prompts = server.prompts
    if req.messages is not None:
        ids = await server.encode(prompts.encode_chat, [m.for_template() for m in req.messages],
                                  req.add_generation_prompt is not False, param="messages")
    else:
        add = req.add_special_tokens is not False
        ids = await server.encode(prompts.encode_text, req.prompt, add, param="prompt")
    return dump(P.TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids))


@router.post("/detokenize", openapi_extra=body_schema(P.DetokenizeRequest))
async def detokenize(request: Request):
    server = server_of(request)
    req = await server.parse(request, P.DetokenizeRequest)
    server.check_model(req.model)
    tok = server.tokenizer
    if tok is None:
        raise APIError(400, "the model has no tokenizer", code="no_tokenizer")
    vocab = len(tok)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:8]}", param="tokens")
    text = await server.prompts.run(tok.decode, req.tokens)
    return dump(P.DetokenizeResponse(prompt=text))


@router.post("/v1/completions", openapi_extra=body_schema(P.CompletionRequest))
async def completions(request: Request):
    return await run(server_of(request), request, CompletionAPI)


@router.post("/v1/chat/completions", openapi_extra=body_schema(P.ChatCompletionRequest))
async def chat_completions(request: Request):
    return await run(server_of(request), request, ChatAPI)


@router.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
async def messages(request: Request):
    return await run(server_of(request), request, MessagesAPI)


@router.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest))
async def messages_count_tokens(request: Request):
    return await count_tokens(server_of(request), request)


@router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
async def responses(request: Request):
    return await run(server_of(request), request, ResponsesAPI)


@router.get("/v1/responses/{response_id}")
async def responses_get(response_id: str, request: Request):
    return await get_response(request, response_id)


@router.delete("/v1/responses/{response_id}")
async def responses_delete(response_id: str, request: Request):
    return await delete_response(request, response_id)
