"""Log-probabilities in OpenAI's two shapes: chat's list of token objects (with UTF-8 bytes) and
the completions API's parallel lists (tokens, token_logprobs, top_logprobs, text_offset).

A token can hold part of a UTF-8 character; its `bytes` are exact and its text shows the
undecodable part as U+FFFD (OpenAI's advice: join the bytes to rebuild such characters).
Plain dicts, since the same values go into streamed chunks and whole responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from appliance.engine.outputs import TokenLogprob
from appliance.engine.tokenizer import Tokenizer

# JSON has no -Infinity: OpenAI reports this floor for tokens the model rules out.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: one object per generated token."""
    return [
        {
            **_chat_token(tokenizer, entry.token_id, entry.logprob),
            "top_logprobs": [_chat_token(tokenizer, t, lp) for t, lp in entry.top],
        }
        for entry in logprobs
    ]


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    data = tokenizer.token_bytes(token_id)
    return {
        "token": data.decode("utf-8", errors="replace"),
        "logprob": _finite(logprob),
        "bytes": list(data),
    }


def completion_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[tuple[int, TokenLogprob | None]],
    first_offset: int,
) -> tuple[dict[str, Any], int]:
    """The completions API's `logprobs` for `tokens` ((id, log-probability or None for the first
    prompt token)), with `text_offset` counting characters from `first_offset` on; and the
    offset after the last token, where the next part starts."""
    texts, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = first_offset
    for token_id, entry in tokens:
        text = token_text(tokenizer, token_id)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_finite(entry.logprob))
            top_logprobs.append({token_text(tokenizer, t): _finite(lp) for t, lp in entry.top})
    logprobs = {
        "tokens": texts,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return logprobs, offset
