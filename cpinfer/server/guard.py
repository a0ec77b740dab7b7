"""The server's outer ASGI layer: a request id for every request, the API key (Bearer or `x-api-key`) checked before
any byte of the body is read, and the body size bounded while it streams in (`Content-Length` over the limit is refused at once; a
chunked body is cut off at the limit), so no client makes the server buffer more than `max_request_bytes`.
"""
from __future__ import annotations

import json
import secrets
import uuid

from cpinfer.server.errors import APIError, error_body_for

OPEN_PATHS = ("/health", "/metrics", "/version")  # never need the key (probes, Prometheus, the version)


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes (--max-request-bytes)",
                         code="request_too_large")


class GuardMiddleware:
    """Pure ASGI middleware (it never buffers the body itself): request id, auth, body limit."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.limit = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        headers = dict(scope.get("headers") or [])
        path = _route_path(scope)
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return await self._reply(send_with_id, APIError(401, "missing or incorrect API key: send the header "
                                                                 "'Authorization: Bearer <key>' (or 'x-api-key: "
                                                                 "<key>')", code="invalid_api_key"), path)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.limit
            except ValueError:
                return await self._reply(send_with_id, APIError(400, "invalid Content-Length header"), path)
            if too_big:
                return await self._reply(send_with_id, BodyTooLarge(self.limit), path)
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, bounded_receive, send_with_id)

    def _authorized(self, headers: dict) -> bool:
        """`Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic clients)."""
        key = self.api_key.encode()
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key):
            return True
        return b"x-api-key" in headers and secrets.compare_digest(headers[b"x-api-key"].strip(), key)

    @staticmethod
    async def _reply(send, err: APIError, path: str) -> None:
        body = json.dumps(error_body_for(path, err.status, err.message, err.param, err.code)).encode()
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _route_path(scope) -> str:
    """The path without the ASGI root_path (--root-path), which servers may include in `path`."""
    path, root = scope["path"], scope.get("root_path") or ""
    return path[len(root):] or "/" if root and path.startswith(root) else path
