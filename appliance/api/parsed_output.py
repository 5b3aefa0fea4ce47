"""One choice's output as the client sees it: its reasoning, its content and its tool calls.

The text goes through the reasoning parser first, if the model reasons
(appliance.api.reasoning_parsers), and its answer then through the tool-call parser, if the
request lets the model call tools (appliance.api.tools): Qwen3 thinks, closes its thought, then
writes its calls. One object serves a whole response and a stream, so they always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.api.reasoning_parsers import Reasoning, ReasoningParser
from appliance.api.tool_parsers import Content
from appliance.api.tools import ChoiceCalls, IdentifiedCall

OutputEvent = Reasoning | Content | IdentifiedCall


@dataclass(frozen=True, slots=True)
class WholeOutput:
    reasoning: str | None  # None: the model did not reason (or has no reasoning parser)
    content: str | None  # None only beside tool calls, when there is no text
    calls: list[IdentifiedCall]


def whole_output(events: Sequence[OutputEvent], calls: list[IdentifiedCall]) -> WholeOutput:
    """The whole output that `events` (all of them, in order) and `calls` make."""
    reasoning = [event.text for event in events if isinstance(event, Reasoning)]
    content = "".join(event.text for event in events if isinstance(event, Content))
    return WholeOutput(
        "".join(reasoning) if reasoning else None, (content or None) if calls else content, calls
    )


class OutputParser(Protocol):
    """One choice's output, parsed as it comes: this module's `ParsedOutput` (text through
    the reasoning and tool-call parsers) or appliance.api.harmony's `HarmonyOutput` (tokens
    through the harmony library)."""

    @property
    def calls(self) -> list[IdentifiedCall]:
        """The calls parsed so far."""
        ...

    def events(self, text: str, token_ids: Sequence[int], *, finished: bool) -> list[OutputEvent]:
        """What the choice's next output (its text and its tokens) adds, in order; `finished`
        for its last."""
        ...

    def whole(self, text: str, token_ids: Sequence[int]) -> WholeOutput:
        """A whole output, parsed."""
        ...


class ParsedOutput:
    def __init__(self, reasoning: ReasoningParser | None, calls: ChoiceCalls | None):
        self._reasoning = reasoning
        self._calls = calls

    @property
    def calls(self) -> list[IdentifiedCall]:
        """The calls parsed so far."""
        return [] if self._calls is None else self._calls.calls

    def events(self, text: str, token_ids: Sequence[int], *, finished: bool) -> list[OutputEvent]:
        """What `text`, the choice's next output, adds, in order; `finished` for its last. A
        thought always comes before the answer, so its events come first. (The tokens are not
        read: these formats are text.)"""
        if self._reasoning is None:
            split: list[Reasoning | Content] = [Content(text)] if text else []
        else:
            split = self._reasoning.feed(text) if text else []
            if finished:
                split += self._reasoning.finish()
        events: list[OutputEvent] = [event for event in split if isinstance(event, Reasoning)]
        answer = "".join(event.text for event in split if isinstance(event, Content))
        if self._calls is not None:
            events += self._calls.events(answer, finished=finished)
        elif answer:
            events.append(Content(answer))
        return events

    def whole(self, text: str, token_ids: Sequence[int]) -> WholeOutput:
        """A whole output, parsed."""
        return whole_output(self.events(text, token_ids, finished=True), self.calls)
