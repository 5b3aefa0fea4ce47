"""Streaming detokenization: text deltas from token ids as they are generated.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often 2-4
tokens), so decoding token by token would emit U+FFFD. This follows the prefix-offset /
read-offset scheme of vLLM and TGI: decode a short window of recent tokens twice (without and with
the new ones) and emit the difference once it no longer ends in an incomplete character. Decoding
the window rather than single tokens also keeps decoders that strip a leading space (SentencePiece)
correct, since both decodes share the same start.
"""

from __future__ import annotations

from appliance.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, never splitting a character.

    Contract: `"".join(deltas from add) + flush()` equals `tokenizer.decode(all ids,
    skip_special_tokens=...)`, and no delta contains U+FFFD unless that full decode does at the
    same place. Each `add` decodes only the tokens since the last emitted delta (the window), so
    the cost per token does not grow with the sequence length.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _window holds the ids from prefix_offset on; _num_read of them were already emitted.
        # Ids before the window are dropped: their text is final.
        self._window: list[int] = []
        self._num_read = 0
        self._parts: list[str] = []

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is open)."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[: self._num_read])
        new_text = self._decode(self._window)
        # A trailing U+FFFD is an incomplete UTF-8 sequence until later tokens prove otherwise.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        # The emitted tokens become the new prefix: the next decode starts at them, not earlier.
        self._window = self._window[self._num_read :]
        self._num_read = len(self._window)
        self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """End of stream: return whatever text is still held back, even an incomplete character."""
        prefix_text = self._decode(self._window[: self._num_read])
        new_text = self._decode(self._window)
        delta = new_text[len(prefix_text) :]
        self._window = []
        self._num_read = 0
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
