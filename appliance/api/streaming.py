"""Server-sent events as OpenAI streams them: `data: <JSON>\\n\\n` per chunk, `data: [DONE]` last.

A chunk is typed: `StreamHead` (what every chunk of a response shares) and, per choice, a
`CompletionChunkChoice` or a `ChatChunkChoice`. Their `json` gives OpenAI's exact field order
and the fields OpenAI leaves out (a chat delta holds only what it adds). Chunks of one response
share everything but their `choices` (and the final `usage`), so the head is serialized once and
each chunk serializes only its choices, its fixed fields written as text and only its values
encoded: the server's CPU per streamed token is one of the appliance's headline figures
(PERFORMANCE.md, W3).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Literal

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from appliance.api.schemas import Usage

DONE = b"data: [DONE]\n\n"


# Made once: `json.dumps` with options builds an encoder per call, which cost more than the
# encoding of a chunk's few fields.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _dumps(value: Any) -> str:
    """Compact JSON, text left unescaped. A string (a chunk's text) or None is written without
    the general encoder's set-up, which `encode` runs for every container: a string as
    `encode` itself writes it (`encode_basestring`, since `ensure_ascii` is off), one call
    fewer per chunk."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return _ENCODER.encode(value)


def event(value: Any) -> bytes:
    """One event carrying `value` as JSON."""
    return b"data: " + _dumps(value).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class StreamHead:
    """What every chunk of one streamed response shares."""

    id: str
    object: Literal["text_completion", "chat.completion.chunk", "response"]
    created: int
    model: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }


@dataclass(frozen=True, slots=True)
class CompletionChunkChoice:
    """A part of a completions choice: text (with its `logprobs` in the completions API's shape,
    when asked for), or, last, no text and the finish reason."""

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None

    def json(self) -> str:
        return (
            f'{{"index":{self.index},"text":{_dumps(self.text)},'
            f'"logprobs":{_dumps(self.logprobs)},"finish_reason":{_dumps(self.finish_reason)}}}'
        )


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """What a chat chunk adds to its message: first the role (with empty content), then
    reasoning, content or parts of tool calls (`tool_calls`, in OpenAI's delta shape: the first
    part of a call has its index, id, type and name, later parts `function.arguments`
    fragments); a choice's last delta adds nothing."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None  # a piece of the model's thought (vLLM's field)

    def json(self) -> str:
        if self.role is not None:
            # OpenAI's opening delta also says that there is no refusal.
            return f'{{"role":{_dumps(self.role)},"content":{_dumps(self.content)},"refusal":null}}'
        if self.tool_calls is not None:
            return f'{{"tool_calls":{_dumps(self.tool_calls)}}}'
        if self.reasoning is not None:
            return f'{{"reasoning":{_dumps(self.reasoning)}}}'
        return "{}" if self.content is None else f'{{"content":{_dumps(self.content)}}}'


@dataclass(frozen=True, slots=True)
class ChatChunkChoice:
    """A part of a chat choice: a delta (with chat's `logprobs`, `{"content": [...]}`, when
    asked for), or, last, an empty delta and the finish reason."""

    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None

    def json(self) -> str:
        return (
            f'{{"index":{self.index},"delta":{self.delta.json()},'
            f'"logprobs":{_dumps(self.logprobs)},"finish_reason":{_dumps(self.finish_reason)}}}'
        )


ChunkChoice = CompletionChunkChoice | ChatChunkChoice


class ChunkWriter:
    """Events of one streamed response: its head and choices.

    With `include_usage`, every chunk carries `"usage": null` and the last one, with no
    choices, the usage (OpenAI's `stream_options.include_usage`).
    """

    def __init__(self, head: StreamHead, *, include_usage: bool):
        self.include_usage = include_usage
        self._head = head.to_json()
        self._prefix = b"data: " + _dumps(self._head)[:-1].encode() + b',"choices":['
        self._suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def chunk(self, *choices: ChunkChoice) -> bytes:
        return self._prefix + ",".join(choice.json() for choice in choices).encode() + self._suffix

    def usage(self, usage: Usage) -> bytes:
        return event({**self._head, "choices": [], "usage": usage.model_dump()})


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
