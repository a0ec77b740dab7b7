"""Every failure in its route's error shape: OpenAI's `{"error": {message, type, param, code}}`, and on the Anthropic
routes (`/v1/messages`, `/v1/messages/count_tokens`) Anthropic's `{"type": "error", "error": {type, message}}`.

400 bad parameters / prompts, 401 missing or wrong API key, 404 unknown routes and models, 413 a body over the
limit, 500 a request that failed on the server, 503 a dead engine. Messages never carry tracebacks or paths.
"""
from __future__ import annotations

import re
from http import HTTPStatus
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpinfer.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable"}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def is_anthropic_route(path: str) -> bool:
    """Whether `path` (with or without a --root-path prefix) is one of the Anthropic routes."""
    return path.rstrip("/").endswith(ANTHROPIC_ROUTES)


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> dict:
    """The error body in the shape of the route at `path`."""
    if is_anthropic_route(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


class APIError(Exception):
    """An error to send back as it is: HTTP status, message, the offending parameter, a short code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   path: str = "") -> JSONResponse:
    return JSONResponse(error_body_for(path, status, message, param, code), status_code=status)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors → one message naming each field, and the first field as `param` (never an input value)."""
    parts, param = [], None
    for err in errors[:8]:
        kind = err.get("type")
        if kind == "json_invalid":  # the body itself: its position is not a parameter
            reason = str(err.get("ctx", {}).get("error", "")) or "invalid JSON"
            return (f"the request body is not valid JSON ({reason}); strings must be valid Unicode (no lone "
                    "surrogates)"), None
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _union_member(x)]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        if kind == "extra_forbidden":
            msg = "unknown or unsupported field (docs/serving.md lists the supported ones)"
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        named = re.match(r"^([a-z_]+): ", msg)
        if not loc and named:  # a check across fields names the one at fault first
            param = param or named.group(1)
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request body", param


def _union_member(part) -> bool:
    """pydantic's label of a union member in an error location (`str`, `list[...]`, `tagged-union[...]`): not a
    field, so left out of the field path."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none"))


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None] | None = None) -> None:
    """Every error becomes the OpenAI shape; `on_error(request, status)` is told about each (for metrics)."""

    def seen(request: Request, status: int) -> None:
        if on_error is not None:
            on_error(request, status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        seen(request, exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        seen(request, 400)
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param, "invalid_parameter", request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        seen(request, exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404:
            message = f"{message}: no such route"
        return error_response(exc.status_code, message, code=HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_"),
                              path=request.url.path)
