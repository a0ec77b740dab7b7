"""Server-sent events that cannot be held hostage by a client that stops reading: each chunk must reach the
connection within `stall_timeout_s`, else the request is aborted (its KV freed) and the connection closed.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from starlette.responses import StreamingResponse

from cpinfer.utils import get_logger

log = get_logger()


class ClientStalled(Exception):
    """The client did not take a chunk within the stall timeout."""


class GuardedSSE(StreamingResponse):
    """`text/event-stream` whose every send must finish within `stall_timeout_s` (a client that stopped reading
    fills the socket's buffers, and the send then waits): past it `on_stall()` runs (the server aborts the request)
    and the response ends unfinished, which makes the ASGI server close the connection."""

    def __init__(self, content, stall_timeout_s: float, on_stall: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self.stall_timeout_s, self.on_stall = stall_timeout_s, on_stall

    async def stream_response(self, send) -> None:
        async def guarded(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        try:
            await super().stream_response(guarded)
        except ClientStalled:
            log.warning("a streaming client took no data for %.0f s: its request is aborted and the connection "
                        "closed", self.stall_timeout_s)
            self.on_stall()
            await self.body_iterator.aclose()
