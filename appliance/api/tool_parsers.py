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
import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from appliance.json_limits import MAX_NESTING_DEPTH, check_nesting


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


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


JSON = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
"""Strict JSON, as a client's parser reads the arguments back: Python's `NaN`, `Infinity` and
numbers that overflow to infinity are refused (`json.dumps` would write them back as `NaN` and
`Infinity`, which are not JSON)."""


def check_json_depth(text: str) -> None:
    """Raise JsonNestingError (a ValueError) if `text` nests JSON arrays and objects deeper than
    appliance.json_limits.MAX_NESTING_DEPTH: JSON the model writes is held to the limit of any
    JSON from outside, so a value is never read by recursion deep enough to fail, and whether a
    call is kept never depends on how deep the caller's stack is (a stream and a whole response
    parse from different depths)."""
    check_nesting(text.encode("utf-8", "surrogatepass"), "the model's JSON")


def decode_json(text: str) -> object:
    """The JSON value `text` spells, or `INVALID_JSON`: malformed JSON, nesting past the limit
    (`check_json_depth`), a non-finite number and an integer past Python's digit limit (a
    `ValueError` of its own) are all invalid, never a crash."""
    try:
        check_json_depth(text)
        return JSON.decode(text)
    except ValueError:  # JSONDecodeError and JsonNestingError are ones
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
    return Call(name, _arguments_text(arguments))


def _arguments_text(arguments: dict[str, object]) -> str:
    """The arguments as JSON text a response can carry: characters as they are, unless a
    string holds a lone surrogate (the model wrote a `\\ud800` escape), which UTF-8 cannot
    encode; then every non-ASCII character is escaped, so the text still spells the same
    value."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(arguments)
    return text


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
    call's body (the text between the markers) in `_call_or_text`.

    Linear in the output however it is split: each piece is scanned once, and a call's text is
    kept as its pieces until CLOSE, which only a new piece (with the end of the call before it)
    can complete."""

    OPEN: str
    CLOSE: str

    def __init__(self, names: Collection[str]):
        self._names = names
        self._pending = ""  # outside a call: text not yet sent, a possible start of OPEN
        self._call: list[str] | None = None  # inside a call: its text so far, OPEN first
        self._call_tail = ""  # the call's last characters, where CLOSE may have begun

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._call is None:
            text, self._pending = self._pending + text, ""
        at = 0  # where the part of `text` not yet read starts
        while True:
            if self._call is not None:
                end = self._close_end(text, at)
                if end < 0:
                    rest = text[at:]
                    self._call.append(rest)
                    self._call_tail = (self._call_tail + rest)[1 - len(self.CLOSE) :]
                    return events
                self._call.append(text[at:end])
                raw = "".join(self._call)
                events.append(self._call_or_text(raw[len(self.OPEN) : -len(self.CLOSE)], raw))
                self._call, at = None, end
                continue
            start = text.find(self.OPEN, at)
            if start < 0:
                rest = text[at:]
                keep = held_prefix_len(rest, self.OPEN)
                sendable, self._pending = rest[: len(rest) - keep], rest[len(rest) - keep :]
                return events + ([Content(sendable)] if sendable else [])
            if start > at:
                events.append(Content(text[at:start]))
            self._call, self._call_tail, at = [], "", start

    def finish(self) -> list[Event]:
        # A model may end on end-of-sequence without closing its last call.
        if self._call is not None:
            raw, self._call = "".join(self._call), None
            return [self._call_or_text(raw[len(self.OPEN) :], raw)]
        pending, self._pending = self._pending, ""
        return [Content(pending)] if pending else []

    def _close_end(self, text: str, at: int) -> int:
        """Where the first CLOSE of the call ends in `text` (read from `at`; CLOSE may have
        begun in the call's tail), or -1."""
        head = self._call_tail + text[at : at + len(self.CLOSE) - 1]
        found = head.find(self.CLOSE)
        if found >= 0:
            return at + found + len(self.CLOSE) - len(self._call_tail)
        found = text.find(self.CLOSE, at)
        return -1 if found < 0 else found + len(self.CLOSE)

    def _call_or_text(self, body: str, raw: str) -> Event:
        """The call `body` spells, or `raw` (the call with its markers) as content."""
        raise NotImplementedError


class HermesParser(_TaggedCallsParser):
    """`<tool_call>{...}</tool_call>` blocks among text (Hermes 2 Pro, Qwen2, Qwen2.5, Qwen3)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _call_or_text(self, body: str, raw: str) -> Event:
        return call_from(decode_json(body), "arguments", self._names) or Content(raw)


_WHITESPACE_RUN = re.compile(r"\s+")


class _CallsOnlyParser:
    """A reply that is either only calls or only text, decided from how it opens (`_decide`):
    text streams from the moment it is decided; calls are read whole at the end (`_calls`),
    and a reply that opened like calls but does not read as them is text.

    Linear in the reply however it is split: the reply is kept as its pieces, and how it opens
    is kept with each run of whitespace cut to one space (markers hold none, so the decision is
    the same), so a reply of whitespace or of a marker and whitespace stays short to decide."""

    def __init__(self, names: Collection[str]):
        self._names = names
        self._pending: list[str] = []  # the reply so far, while it may be calls
        self._start = ""  # how it opens: less leading whitespace, each run cut to one space
        self._mode: str | None = None  # None until decided, then "text" or "calls"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [Content(text)] if text else []
        self._pending.append(text)
        if self._mode is None:
            self._start = _WHITESPACE_RUN.sub(" ", self._start + text).lstrip()
            self._mode = self._decide(self._start)
            if self._mode == "text":
                pending, self._pending = "".join(self._pending), []
                return [Content(pending)]
        return []

    def finish(self) -> list[Event]:
        pending, self._pending = "".join(self._pending), []
        if self._mode != "calls":
            return [Content(pending)] if pending else []
        calls = self._calls(pending)
        return list(calls) if calls else [Content(pending)]

    def _decide(self, start: str) -> str | None:
        """ "calls", "text", or None while `start` (the reply so far, less leading whitespace,
        each run of whitespace cut to one space) could still become either."""
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
        calls: list[Call] = []
        position = 0
        try:
            check_json_depth(text)
            while position < len(text):
                value, position = JSON.raw_decode(text, position)
                call = call_from(value, "parameters", self._names) or call_from(
                    value, "arguments", self._names
                )
                if call is None:
                    return None
                calls.append(call)
                while position < len(text) and text[position] in " \t\r\n;":
                    position += 1
        except ValueError:  # as in decode_json
            return None
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
            check_json_depth(text)
            value, end = JSON.raw_decode(text)
        except ValueError:  # as in decode_json
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
    vLLM's `gemma4` parser reads them. `parse` gives the arguments object or INVALID_JSON;
    objects and arrays nested deeper than MAX_NESTING_DEPTH (the arguments object is the first
    level) are invalid, as JSON's are (`check_json_depth`)."""

    QUOTE = '<|"|>'

    def __init__(self, text: str):
        self._text = text
        self._at = 0
        self._depth = 1  # of the object or array being read

    def parse(self) -> object:
        try:
            value = self._object_body("")
        except ValueError:
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
        if text.startswith(("{", "["), at):
            return self._nested(text[at])
        end = at
        while end < len(text) and text[end] not in ",]}":
            end += 1
        self._at = end
        return self._bare(text[at:end].strip())

    def _nested(self, opening: str) -> object:
        """The object or array that `opening`, the character being read, starts."""
        self._at += 1
        self._depth += 1
        if self._depth > MAX_NESTING_DEPTH:
            raise ValueError(f"nested deeper than {MAX_NESTING_DEPTH} levels")
        value = self._object_body("}") if opening == "{" else self._array_body()
        self._depth -= 1
        return value

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
