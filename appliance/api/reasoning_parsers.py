"""A reasoning model's thinking, told apart from its answer: a registry of parsers keyed by
format, as vLLM names its `--reasoning-parser`s.

- `qwen3`: Qwen3 thinks in `<think>\\n...\\n</think>\\n\\n` before its answer (the template may
  put the opening tag in the prompt, so only the closing one is generated). With
  `chat_template_kwargs.enable_thinking: false` the template closes an empty thought in the
  prompt and everything generated is the answer. An output cut off before `</think>` is all
  reasoning, as vLLM's parser has it.
- `gemma4`: Gemma 4 may open its answer with a thought, `<|channel>thought\n...<channel|>`
  (special tokens, so its output is decoded with them kept, chat_conventions); its template
  turns thinking on with `enable_thinking`. An output that does not open with the channel is
  all answer; one cut off inside it is all reasoning.

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
        self._pending = ""  # text not yet sent: a possible tag
        # Newlines after the thought so far, held back since they may end it: counted, not
        # kept, so a thought of newlines costs no more per piece than one of text.
        self._num_newlines = 0
        self._opened = False  # an opening tag, or any reasoning text, has been seen
        self._thought_started = False  # some reasoning has been sent
        self._answer_started = False  # some answer text has been sent

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._pending += text
        return self._thought() if self._thinking else self._answer()

    def finish(self) -> list[ReasoningEvent]:
        pending, self._pending = self._pending, ""
        if not self._thinking:
            return [Content(pending)] if pending else []
        if not self._opened:
            return []  # nothing but newlines and part of an opening tag
        # Cut off mid-thought: what it wrote so far is reasoning.
        return self._reasoning(pending)

    def _thought(self) -> list[ReasoningEvent]:
        if not self._opened:
            self._pending = self._pending.lstrip("\n")
            if self.OPEN.startswith(self._pending):
                return []  # still possibly the opening tag
            self._pending = self._pending.removeprefix(self.OPEN)
            self._opened = True
        end = self._pending.find(self.CLOSE)
        if end >= 0:
            thought = self._pending[:end].rstrip("\n")
            self._pending = self._pending[end + len(self.CLOSE) :]
            self._thinking = False
            return self._reasoning(thought) + self._answer()
        # Hold back what may start the closing tag, and newlines that may precede it.
        keep = held_prefix_len(self._pending, self.CLOSE)
        sendable = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(sendable) :]
        thought = sendable.rstrip("\n")
        events = self._reasoning(thought)
        self._num_newlines += len(sendable) - len(thought)
        return events

    def _reasoning(self, text: str) -> list[ReasoningEvent]:
        """`text`, more of the thought, after the newlines held back before it; the newlines
        that open the thought are the template's, however the pieces split them."""
        if not self._thought_started:
            text, self._num_newlines = text.lstrip("\n"), 0
        if not text:
            return []
        text, self._num_newlines = "\n" * self._num_newlines + text, 0
        self._thought_started = True
        return [Reasoning(text)]

    def _answer(self) -> list[ReasoningEvent]:
        if not self._answer_started:
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return []
            self._answer_started = True
        text, self._pending = self._pending, ""
        return [Content(text)]


class Gemma4ChannelParser:
    """`<|channel>thought\n...<channel|>` before the answer (Gemma 4). The `thought\n` label
    names the channel and belongs to neither part; a request with thinking off may still get
    an (empty) channel, which is parsed the same way."""

    OPEN, LABEL, CLOSE = "<|channel>", "thought\n", "<channel|>"

    def __init__(self, *, thinking: bool):
        del thinking  # the output says whether it thinks: a thought opens with OPEN
        self._pending = ""  # text not yet sent: a possible opening, label or closing tag
        self._state = "start"  # then "label", "thought" or "answer"

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._pending += text
        events: list[ReasoningEvent] = []
        if self._state == "start":
            if self.OPEN.startswith(self._pending):
                return []  # still possibly the opening tag
            if not self._pending.startswith(self.OPEN):
                self._state = "answer"
            else:
                self._pending = self._pending[len(self.OPEN) :]
                self._state = "label"
        if self._state == "label":
            if self.LABEL.startswith(self._pending):
                return []
            self._pending = self._pending.removeprefix(self.LABEL)
            self._state = "thought"
        if self._state == "thought":
            end = self._pending.find(self.CLOSE)
            if end < 0:
                keep = held_prefix_len(self._pending, self.CLOSE)
                thought = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(thought) :]
                return [Reasoning(thought)] if thought else []
            if end:
                events.append(Reasoning(self._pending[:end]))
            self._pending = self._pending[end + len(self.CLOSE) :]
            self._state = "answer"
        text, self._pending = self._pending, ""
        return events + ([Content(text)] if text else [])

    def finish(self) -> list[ReasoningEvent]:
        pending, self._pending = self._pending, ""
        cut_in_tag = self._state == "label" or (
            self._state == "start" and self.OPEN.startswith(pending)
        )
        if not pending or cut_in_tag:
            return []  # nothing, or cut off in the opening tag or label, before any thought
        if self._state == "thought":
            return [Reasoning(pending)]
        return [Content(pending)]


REASONING_PARSERS: dict[str, Callable[..., ReasoningParser]] = {
    "qwen3": ThinkTagParser,
    "gemma4": Gemma4ChannelParser,
}
"""Every reasoning format this server parses, by name; each takes `thinking=` (whether the
request leaves thinking on)."""
