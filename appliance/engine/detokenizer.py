"""Streaming detokenization: text deltas from token ids as they are generated.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often 2-4
tokens), so decoding token by token would emit U+FFFD. This follows the prefix-offset /
read-offset scheme of vLLM and TGI: decode a short window of recent tokens without and with the
new ones and emit the difference once it no longer ends in an incomplete character. Decoding the
window rather than single tokens also keeps decoders that strip a leading space (SentencePiece)
correct, since both decodes share the same start. The decode without the new token is the one
the previous delta already made, kept, so a token costs one decode until the window restarts.

A tokenizer whose decode is just its tokens' bytes joined and read as UTF-8 (byte-level BPE:
`Tokenizer.byte_pieces`) needs no decode at all: `ByteDetokenizer` keeps the bytes not yet
emitted and emits them once they end on a whole character, the same deltas as the window's
for a fraction of the cost (the engine thread's CPU per token, issue 17's W3).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from appliance.engine.tokenizer import Tokenizer

# Past this many ids, the window restarts at the last delta's ids (one extra decode): the window
# stays short, so a decode costs the same whatever the sequence's length.
_MAX_WINDOW_IDS = 4


class Detokenizer(Protocol):
    """One sequence's generated ids to text deltas. Contract: `"".join(deltas from add) +
    flush()` equals `tokenizer.decode(all ids, skip_special_tokens=...)`, and no delta contains
    U+FFFD unless that full decode does at the same place."""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is
        open)."""
        ...

    def flush(self) -> str:
        """End of stream: return whatever text is still held back, even an incomplete
        character."""
        ...


def detokenizer_for(tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> Detokenizer:
    """A new stream's detokenizer: bytewise where the tokenizer allows it, else by window."""
    pieces = tokenizer.byte_pieces(skip_special_tokens=skip_special_tokens)
    if pieces is not None:
        return ByteDetokenizer(pieces)
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)


class ByteDetokenizer:
    """The `Detokenizer` of a tokenizer that decodes bytewise (`Tokenizer.byte_pieces`).

    Its deltas are those of `IncrementalDetokenizer` over the same tokenizer, token for token:
    that one's window always starts where a delta ended, on a whole character (a decode that
    ends otherwise ends in U+FFFD and is held), so its delta is the decode of the bytes since
    the last one, which is what this one emits. A lossy UTF-8 decode of bytes that follow a
    whole character does not depend on what came before it.
    """

    def __init__(self, pieces: Mapping[int, bytes]) -> None:
        self._pieces = pieces
        self._unemitted = b""  # held since the last delta: they end in U+FFFD

    def add(self, token_id: int) -> str:
        data = self._unemitted + self._pieces[token_id]
        if not data:
            return ""  # a skipped special token, nothing held
        text = data.decode("utf-8", "replace")
        # A trailing U+FFFD is an incomplete UTF-8 sequence until later tokens prove otherwise.
        if text[-1] == "\ufffd":
            self._unemitted = data
            return ""
        self._unemitted = b""
        return text

    def flush(self) -> str:
        text = self._unemitted.decode("utf-8", "replace")
        self._unemitted = b""
        return text


class IncrementalDetokenizer:
    """The `Detokenizer` of any tokenizer, by decoding a window of recent ids (module
    docstring). Each `add` decodes only a short window, so the cost per token does not grow
    with the sequence length; the window's emitted text is kept, so most tokens cost one
    decode, not two (the server's CPU per streamed token, PERFORMANCE.md W3).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _window holds the ids from prefix_offset on; _num_read of them were already emitted,
        # and _read_text is their decode. Ids before the window are dropped: their text is final.
        self._window: list[int] = []
        self._num_read = 0
        self._read_text = ""
        self._parts: list[str] = []

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is open)."""
        window = self._window
        window.append(token_id)
        new_text = self._decode(window)
        # A trailing U+FFFD is an incomplete UTF-8 sequence until later tokens prove otherwise.
        if len(new_text) <= len(self._read_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(self._read_text) :]
        if len(window) > _MAX_WINDOW_IDS:
            # The ids just emitted become the new prefix: later decodes start at them.
            self._window = window[self._num_read :]
            self._read_text = self._decode(self._window)
        else:
            self._read_text = new_text
        self._num_read = len(self._window)
        self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """End of stream: return whatever text is still held back, even an incomplete character."""
        delta = self._decode(self._window)[len(self._read_text) :]
        self._window = []
        self._num_read = 0
        self._read_text = ""
        if delta:
            self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far (by `add` and `flush`)."""
        return "".join(self._parts)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
