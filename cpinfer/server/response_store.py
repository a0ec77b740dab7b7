"""The conversations `POST /v1/responses` keeps for `previous_response_id`: each stored response's body and the chat
messages that led to it (its own output included), bounded in count and in bytes and evicted oldest first.

The K/V of a stored conversation is not held here: the next turn's prompt extends the stored one, and the engine's
prefix tree finds what of it is still resident (sharded over the CP ranks), as it does for a resent chat history.
"""
from __future__ import annotations

import collections
import dataclasses
import json


@dataclasses.dataclass
class Stored:
    body: dict  # the response as GET /v1/responses/{id} returns it
    messages: list[dict]  # chat-template messages: the conversation up to and including this response's output
    nbytes: int


class ResponseStore:
    """Newest `max_count` responses within `max_bytes` (their JSON size); the oldest go first. Remembers the ids of
    the last evicted ones, so a lookup can say "evicted" rather than "unknown"."""

    def __init__(self, max_count: int, max_bytes: int):
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must be >= 0, got {max_count} responses, {max_bytes} bytes")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._evicted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, body: dict, messages: list[dict]) -> bool:
        """Store a response (False when it alone exceeds the byte bound: it is not kept)."""
        nbytes = len(json.dumps(body)) + len(json.dumps(messages))
        if nbytes > self.max_bytes or self.max_count == 0:
            self._forget(response_id)
            return False
        self.delete(response_id)
        self._items[response_id] = Stored(body, messages, nbytes)
        self.nbytes += nbytes
        while len(self._items) > self.max_count or self.nbytes > self.max_bytes:
            old, item = self._items.popitem(last=False)
            self.nbytes -= item.nbytes
            self._forget(old)
        return True

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def was_evicted(self, response_id: str) -> bool:
        return response_id in self._evicted

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.nbytes -= item.nbytes
        return True

    def _forget(self, response_id: str) -> None:
        self._evicted[response_id] = None
        while len(self._evicted) > max(1024, 4 * self.max_count):
            self._evicted.popitem(last=False)
