"""Tool calls in a model's output, in the format its chat template taught it: a registry of
parsers keyed by format, and the format a template writes.

Formats (as vLLM names its parsers):

- `hermes`: Hermes 2 Pro, Qwen2, Qwen2.5 and Qwen3 wrap each call in
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after any text.
- `llama3_json`: Llama 3.1 and 3.2 answer a call with nothing but
  `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`, a special token the decoded text
  usually drops); several calls are separated by `;`.
- `granite`: Granite 3 answers a call with nothing but a JSON array of
  `{"name": ..., "arguments": {...}}`, after `<|tool_call|>` (a special token the decoded text
  drops; 3.1 may write `<tool_call>` instead).
- `phi4_mini_json`: Phi-4-mini, under the tool template vLLM ships for it (its own template
  shows no tools), answers a call with nothing but `functools[{"name": ..., "arguments": ...}]`.
- `gemma4`: Gemma 4 writes each call as `<|tool_call>call:NAME{ARGS}<tool_call|>`, after any
  text, calls back to back; ARGS is its own notation (`Gemma4Arguments`), not JSON. Its markers
  are special tokens, so its output is decoded with them kept (chat_conventions).

A parser is incremental (`feed` the text as it is generated, then `finish`) and gives back
`Content` (text to send) and `Call` (a complete, valid call) events. The one parser serves both
a whole response and a stream, so they always agree. It holds back text that could still be
the start of a call until that is decided, and a call until it is complete: a call is sent
whole (valid JSON arguments, a function the request offered) or not at all. Model output never
fails a request: text that looks like a call but is not one (malformed JSON, an unknown
function, a missing name) is sent as plain content, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text


Event = Content | Call


class ToolCallParser(Protocol):
    """One choice's output: `feed` each new piece of text, then `finish` once."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


INVALID_JSON = object()


def decode_json(text: str) -> object:
    """The JSON value `text` spells, or `INVALID_JSON`; model output nested deeper than Python's
    recursion limit is invalid too, not a crash."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return INVALID_JSON


def call_from(value: object, arguments_key: str, names: Collection[str]) -> Call | None:
    """A call from one decoded JSON value, or None when it is not a call to an offered
    function with an object of arguments (a JSON object, or one as a string)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    name, arguments = value["name"], value.get(arguments_key, {})
    if name not in names:
        return None
    if isinstance(arguments, str):
        arguments = decode_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return Call(name, json.dumps(arguments, ensure_ascii=False))


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a start of `marker` (text to hold back,
    since the next piece may complete the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class _TaggedCallsParser:
    """Calls between an OPEN and a CLOSE marker, among text: the loop that splits a stream into
    text and calls, shared by the formats that write calls this way. A subclass reads one
    call's body (the text between the markers) in `_call_or_text`."""

    OPEN: str
    CLOSE: str

    def __init__(self, names: Collection[str]):
        self._names = names
        self._pending = ""  # text not yet sent: a possible start of OPEN, or an open call
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._pending.find(self.CLOSE)
                if end < 0:
                    return events
                raw = self._pending[: end + len(self.CLOSE)]
                events.append(self._call_or_text(self._pending[len(self.OPEN) : end], raw))
                self._pending = self._pending[len(raw) :]
                self._in_call = False
                continue
            start = self._pending.find(self.OPEN)
            if start < 0:
                keep = held_prefix_len(self._pending, self.OPEN)
                sendable = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(sendable) :]
                return events + ([Content(sendable)] if sendable else [])
            if start:
                events.append(Content(self._pending[:start]))
            self._pending = self._pending[start:]
            self._in_call = True

    def finish(self) -> list[Event]:
        # A model may end on end-of-sequence without closing its last call.
        pending, self._pending = self._pending, ""
        if self._in_call:
            return [self._call_or_text(pending[len(self.OPEN) :], pending)]
        return [Content(pending)] if pending else []

    def _call_or_text(self, body: str, raw: str) -> Event:
        """The call `body` spells, or `raw` (the call with its markers) as content."""
        raise NotImplementedError


class HermesParser(_TaggedCallsParser):
    """`<tool_call>{...}</tool_call>` blocks among text (Hermes 2 Pro, Qwen2, Qwen2.5, Qwen3)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _call_or_text(self, body: str, raw: str) -> Event:
        return call_from(decode_json(body), "arguments", self._names) or Content(raw)


class _CallsOnlyParser:
    """A reply that is either only calls or only text, decided from how it opens (`_decide`):
    text streams from the moment it is decided; calls are read whole at the end (`_calls`),
    and a reply that opened like calls but does not read as them is text."""

    def __init__(self, names: Collection[str]):
        self._names = names
        self._pending = ""
        self._mode: str | None = None  # None until decided, then "text" or "calls"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [Content(text)] if text else []
        self._pending += text
        if self._mode is None:
            self._mode = self._decide(self._pending.lstrip())
            if self._mode == "text":
                pending, self._pending = self._pending, ""
                return [Content(pending)]
        return []

    def finish(self) -> list[Event]:
        pending, self._pending = self._pending, ""
        if self._mode != "calls":
            return [Content(pending)] if pending else []
        calls = self._calls(pending)
        return list(calls) if calls else [Content(pending)]

    def _decide(self, start: str) -> str | None:
        """ "calls", "text", or None while `start` (the reply so far, less leading white space)
        could still become either."""
        raise NotImplementedError

    def _calls(self, reply: str) -> list[Call] | None:
        """The calls of a whole reply, or None unless all of it is valid calls."""
        raise NotImplementedError


class Llama3JsonParser(_CallsOnlyParser):
    """A reply that is only JSON calls, `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>` and separated by `;` (Llama 3.1, 3.2)."""

    PYTHON_TAG = "<|python_tag|>"

    def _decide(self, start: str) -> str | None:
        if not start or (self.PYTHON_TAG.startswith(start) and start != self.PYTHON_TAG):
            return None  # only whitespace, or part of the tag, so far
        return "calls" if start.startswith(("{", self.PYTHON_TAG)) else "text"

    def _calls(self, reply: str) -> list[Call] | None:
        text = reply.strip().removeprefix(self.PYTHON_TAG)
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        position = 0
        while position < len(text):
            try:
                value, position = decoder.raw_decode(text, position)
            except (json.JSONDecodeError, RecursionError):
                return None
            call = call_from(value, "parameters", self._names) or call_from(
                value, "arguments", self._names
            )
            if call is None:
                return None
            calls.append(call)
            while position < len(text) and text[position] in " \t\r\n;":
                position += 1
        return calls


class _MarkedCallsArrayParser(_CallsOnlyParser):
    """A reply that is only a JSON array of calls after the format's markers (each optional in
    order, unless MARKER_REQUIRED says the first must be there); any other reply is text."""

    MARKERS: tuple[str, ...]
    MARKER_REQUIRED: bool

    def _decide(self, start: str) -> str | None:
        rest, marked = start, False
        for marker in self.MARKERS:
            if len(rest) < len(marker) and marker.startswith(rest):
                return None
            if rest.startswith(marker):
                rest, marked = rest[len(marker) :].lstrip(), True
        if not rest:
            return None
        if rest.startswith("[") and (marked or not self.MARKER_REQUIRED):
            return "calls"
        return "text"

    def _calls(self, reply: str) -> list[Call] | None:
        text = reply.lstrip()
        for marker in self.MARKERS:
            text = text.removeprefix(marker).lstrip()
        try:
            value, end = json.JSONDecoder().raw_decode(text)
        except (json.JSONDecodeError, RecursionError):
            return None
        if text[end:].strip() or not isinstance(value, list) or not value:
            return None
        calls = [
            call_from(item, "arguments", self._names) or call_from(item, "parameters", self._names)
            for item in value
        ]
        return None if None in calls else calls  # type: ignore[return-value]


class GraniteParser(_MarkedCallsArrayParser):
    """`<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3.0 to 3.3; vLLM's
    `granite`)."""

    MARKERS = ("<|tool_call|>", "<tool_call>")
    MARKER_REQUIRED = False  # the special token is dropped from the decoded text


class Phi4MiniJsonParser(_MarkedCallsArrayParser):
    """`functools[{"name": ..., "arguments": {...}}, ...]` (Phi-4-mini; vLLM's
    `phi4_mini_json`)."""

    MARKERS = ("functools",)
    MARKER_REQUIRED = True


class Gemma4Arguments:
    """Gemma 4's argument notation, decoded: an object's keys bare (or in string quotes),
    strings between `<|"|>` quotes (anything inside, no escapes), objects `{k:v,...}`, arrays
    `[v,...]`, and bare true, false, null and numbers, as its chat template writes them and
    vLLM's `gemma4` parser reads them. `parse` gives the arguments object or INVALID_JSON."""

    QUOTE = '<|"|>'

    def __init__(self, text: str):
        self._text = text
        self._at = 0

    def parse(self) -> object:
        try:
            value = self._object_body("")
        except (ValueError, RecursionError):
            return INVALID_JSON
        return value if self._at == len(self._text) else INVALID_JSON

    def _object_body(self, close: str) -> dict[str, object]:
        """Pairs up to `close` (consumed; "" for the end of the text)."""
        value: dict[str, object] = {}
        while not self._closes(close):
            colon = self._text.find(":", self._at)
            if colon < 0:
                raise ValueError("a key without a value")
            key = self._text[self._at : colon].strip()
            key = key.removeprefix(self.QUOTE).removesuffix(self.QUOTE)
            if not key:
                raise ValueError("an empty key")
            self._at = colon + 1
            value[key] = self._value(close)
            self._separator(close)
        return value

    def _array_body(self) -> list[object]:
        items: list[object] = []
        while not self._closes("]"):
            items.append(self._value("]"))
            self._separator("]")
        return items

    def _closes(self, close: str) -> bool:
        self._skip_space()
        if not close:
            return self._at == len(self._text)
        if self._text.startswith(close, self._at):
            self._at += len(close)
            return True
        if self._at == len(self._text):
            raise ValueError(f"unclosed before {close!r}")
        return False

    def _separator(self, close: str) -> None:
        self._skip_space()
        if self._text.startswith(",", self._at):
            self._at += 1
            return
        at_close = self._text.startswith(close, self._at) if close else self._at == len(self._text)
        if not at_close:
            raise ValueError("values must be separated by commas")

    def _value(self, close: str) -> object:
        self._skip_space()
        text, at = self._text, self._at
        if text.startswith(self.QUOTE, at):
            end = text.find(self.QUOTE, at + len(self.QUOTE))
            if end < 0:
                raise ValueError("an unterminated string")
            self._at = end + len(self.QUOTE)
            return text[at + len(self.QUOTE) : end]
        if text.startswith("{", at):
            self._at += 1
            return self._object_body("}")
        if text.startswith("[", at):
            self._at += 1
            return self._array_body()
        end = at
        while end < len(text) and text[end] not in ",]}":
            end += 1
        self._at = end
        return self._bare(text[at:end].strip())

    @staticmethod
    def _bare(word: str) -> object:
        if not word:
            raise ValueError("a missing value")
        constants: dict[str, object] = {"true": True, "false": False, "null": None}
        if word in constants:
            return constants[word]
        number = decode_json(word)
        if isinstance(number, int | float):
            return number
        if ":" in word:
            raise ValueError("a value runs into the next key (a missing comma)")
        return word  # a string the model left unquoted, as vLLM takes it

    def _skip_space(self) -> None:
        while self._at < len(self._text) and self._text[self._at] in " \t\r\n":
            self._at += 1


class Gemma4Parser(_TaggedCallsParser):
    """`<|tool_call>call:NAME{ARGS}<tool_call|>` calls among text (Gemma 4; vLLM's `gemma4`)."""

    OPEN, CLOSE, PREFIX = "<|tool_call>", "<tool_call|>", "call:"

    def _call_or_text(self, body: str, raw: str) -> Event:
        """body: `call:NAME{ARGS}`."""
        brace = body.find("{")
        if not body.startswith(self.PREFIX) or brace < 0 or not body.rstrip().endswith("}"):
            return Content(raw)
        name = body[len(self.PREFIX) : brace].strip()
        arguments = Gemma4Arguments(body[brace + 1 : body.rstrip().rfind("}")]).parse()
        return call_from({"name": name, "arguments": arguments}, "arguments", self._names) or (
            Content(raw)
        )


class ForcedCallsParser:
    """The output of a request whose `tool_choice` forces calls, written under a grammar
    (appliance.api.tools.forced_calls), as vLLM writes it: for a named function, the arguments
    object alone; for `required`, a JSON array of `{"name": ..., "parameters": {...}}`. The
    grammar guarantees the shape, so the whole output is one event at the end; text cut off by
    max_tokens (no longer a valid call) comes back as content."""

    def __init__(self, names: Collection[str], function: str | None):
        self._names = names
        self._function = function
        self._text: list[str] = []

    def feed(self, text: str) -> list[Event]:
        self._text.append(text)
        return []

    def finish(self) -> list[Event]:
        text = "".join(self._text)
        value = decode_json(text)
        if self._function is not None:
            call = call_from({"name": self._function, "arguments": value}, "arguments", self._names)
            calls = [] if call is None else [call]
        elif isinstance(value, list):
            calls = [c for item in value if (c := call_from(item, "parameters", self._names))]
            calls = calls if len(calls) == len(value) else []
        else:
            calls = []
        return list(calls) if calls else [Content(text)] if text else []


ParserFactory = Callable[[Collection[str]], ToolCallParser]

PARSERS: dict[str, ParserFactory] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "granite": GraniteParser,
    "phi4_mini_json": Phi4MiniJsonParser,
    "gemma4": Gemma4Parser,
}
"""Every tool-call format this server parses, by name."""


def format_of_template(chat_template: str) -> str | None:
    """The tool-call format a chat template teaches its model, from what the template writes
    for an assistant's tool calls or asks of it; None for a template this server has no parser
    for. Granite's marker is tested first: its templates may mention `<tool_call>` too."""
    if "<|tool_call|>" in chat_template and "<|start_of_role|>" in chat_template:
        return "granite"
    if Gemma4Parser.OPEN in chat_template and Gemma4Parser.CLOSE in chat_template:
        return "gemma4"
    if HermesParser.OPEN in chat_template:
        return "hermes"
    if "functools[" in chat_template:
        return "phi4_mini_json"
    if '"parameters": ' in chat_template and "<|start_header_id|>" in chat_template:
        return "llama3_json"
    return None
