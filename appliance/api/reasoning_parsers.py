"""A reasoning model's thinking, told apart from its answer: a registry of parsers keyed by
format, as vLLM names its `--reasoning-parser`s.

- `qwen3`: Qwen3 thinks in `<think>\\n...\\n</think>\\n\\n` before its answer (the template may
  put the opening tag in the prompt, so only the closing one is generated). With
  `chat_template_kwargs.enable_thinking: false` the template closes an empty thought in the
  prompt and everything generated is the answer. An output cut off before `</think>` is all
  reasoning, as vLLM's parser has it.

A parser is incremental, like the tool-call parsers (appliance.api.tool_parsers): `feed` the
text as it is generated, then `finish`; it gives back `Reasoning` and `Content` events, holding
back only text that could still be part of a tag, so a tag split across tokens is found. The
newlines the template writes around the thought and before the answer are not part of either
(the template writes them again when the message comes back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from appliance.api.tool_parsers import Content, held_prefix_len


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


ReasoningEvent = Reasoning | Content


class ReasoningParser(Protocol):
    """One choice's output: `feed` each new piece of text, then `finish` once."""

    def feed(self, text: str) -> list[ReasoningEvent]: ...

    def finish(self) -> list[ReasoningEvent]: ...


class ThinkTagParser:
    """`<think>...</think>` before the answer (Qwen3, QwQ, DeepSeek-R1 distills)."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, *, thinking: bool):
        self._thinking = thinking  # False: the prompt closed the thought already
        self._pending = ""  # text not yet sent: a possible tag, or newlines that may end a thought
        self._opened = False  # an opening tag, or any reasoning text, has been seen
        self._answer_started = False  # some answer text has been sent

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._pending += text
        return self._thought() if self._thinking else self._answer()

    def finish(self) -> list[ReasoningEvent]:
        pending, self._pending = self._pending, ""
        if not self._thinking:
            return [Content(pending)] if pending else []
        # Cut off mid-thought: what it wrote so far is reasoning (less a lone opening tag).
        if not self._opened:
            pending = pending.lstrip("\n")
            pending = "" if self.OPEN.startswith(pending) else pending
        text = pending.rstrip("\n")
        return [Reasoning(text)] if text else []

    def _thought(self) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        if not self._opened:
            stripped = self._pending.lstrip("\n")
            if self.OPEN.startswith(stripped):
                return []  # still possibly the opening tag
            self._pending = stripped.removeprefix(self.OPEN).lstrip("\n")
            self._opened = True
        end = self._pending.find(self.CLOSE)
        if end >= 0:
            thought = self._pending[:end].rstrip("\n")
            self._pending = self._pending[end + len(self.CLOSE) :]
            self._thinking = False
            if thought:
                events.append(Reasoning(thought))
            return events + self._answer()
        # Hold back what may start the closing tag, and newlines that may precede it.
        keep = held_prefix_len(self._pending, self.CLOSE)
        sendable = self._pending[: len(self._pending) - keep]
        trimmed = sendable.rstrip("\n")
        self._pending = sendable[len(trimmed) :] + self._pending[len(sendable) :]
        if trimmed:
            events.append(Reasoning(trimmed))
        return events

    def _answer(self) -> list[ReasoningEvent]:
        if not self._answer_started:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return []
            self._answer_started = True
        text, self._pending = self._pending, ""
        return [Content(text)]


REASONING_PARSERS: dict[str, Callable[..., ReasoningParser]] = {
    "qwen3": ThinkTagParser,
}
"""Every reasoning format this server parses, by name; each takes `thinking=` (whether the
request leaves thinking on)."""
