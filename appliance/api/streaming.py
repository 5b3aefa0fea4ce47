"""Server-sent events as OpenAI streams them: `data: <JSON>\\n\\n` per chunk, `data: [DONE]` last.

Chunks of one response share everything but their `choices` (and the final `usage`), so the
shared part is serialized once and each chunk serializes only its choices: the server's CPU per
streamed token is one of the appliance's headline figures (PERFORMANCE.md, W3).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def event(value: Any) -> bytes:
    """One event carrying `value` as JSON."""
    return b"data: " + _dumps(value).encode() + b"\n\n"


class ChunkWriter:
    """Events of one streamed response: `head` (id, object, created, model ...) and choices.

    With `include_usage`, every chunk carries `"usage": null` and the last one, with no
    choices, the usage (OpenAI's `stream_options.include_usage`).
    """

    def __init__(self, head: dict[str, Any], *, include_usage: bool):
        self.include_usage = include_usage
        self._prefix = b"data: " + _dumps(head)[:-1].encode() + b',"choices":['
        self._suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._head = head

    def chunk(self, *choices: dict[str, Any]) -> bytes:
        return self._prefix + ",".join(map(_dumps, choices)).encode() + self._suffix

    def usage(self, usage: dict[str, Any]) -> bytes:
        return event({**self._head, "choices": [], "usage": usage})


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that, however it ends (finished, client gone, cancelled),
    closes its body generator (so the generator's clean-up, such as aborting engine requests,
    runs now rather than whenever it is garbage-collected) and then calls `on_close`."""

    def __init__(self, content: AsyncGenerator[bytes, None], *, on_close: Callable[[], None]):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()
            finally:
                self._on_close()
