"""The FastAPI app of `cpinfer serve`: OpenAI and Anthropic routes as a thin layer over `AsyncLLM` (docs/engine.md).

Every request passes the guard (request id, API key before the body, body-size limit), then its body is parsed
strictly and its prompt templated and tokenized in a thread pool, never on the event loop; a bad request is a 400
before any compute. A multi-turn chat resends its history; the engine's prefix tree finds the earlier turns' K/V
still sharded over the CP ranks (persistent KV, paper §3.3) and `usage.prompt_tokens_details.cached_tokens` says
how many prompt tokens were reused. Failures reach clients as OpenAI errors (Anthropic's on /v1/messages) carrying
the request id, never as tracebacks, paths or exception text; the details go to the server log under that id. The
routes are module-level functions (routes.py); what they share is `app.state.server` (state.py).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from cpinfer.server import protocol as P
from cpinfer.server.errors import error_response, install_error_handlers
from cpinfer.server.guard import GuardMiddleware
from cpinfer.server.messages import CountTokensRequest, MessagesRequest
from cpinfer.server.responses import ResponsesRequest
from cpinfer.server.routes import router
from cpinfer.server.state import OpenAIServer, ServerConfig, default_max_request_bytes  # noqa: F401 - the API
from cpinfer.utils import get_logger

log = get_logger()


def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app for one engine (shut the engine down yourself after the server stops)."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="cpinfer", description="OpenAI-compatible context-parallel inference server",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json" if config.enable_docs else None)
    app.state.server = server
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_request_bytes=server.max_request_bytes)
    if config.allowed_origins:  # outermost: browsers' preflight requests are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in config.allowed_origins)
    install_error_handlers(app, server.count_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)
    _install_openapi(app, [P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest,
                           MessagesRequest, CountTokensRequest, ResponsesRequest])
    return app


async def _unexpected(request: Request, exc: Exception):
    request.app.state.server.count_error(request, 500)
    rid = request.scope.get("state", {}).get("request_id", "-")
    log.exception("request %s %s failed", rid, request.url.path, exc_info=exc)
    return error_response(500, f"internal error; the server log has the details under request id {rid}",
                          code="internal_error", path=request.url.path)


def _install_openapi(app: FastAPI, models: list[type]) -> None:
    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
