"""The exact bytes of streamed chunks: OpenAI's field order, the fields a chat delta leaves out,
`"usage": null` only when usage is asked for, and text left unescaped."""

from __future__ import annotations

import json

from appliance.api.schemas import PromptTokensDetails, Usage
from appliance.api.streaming import (
    ChatChunkChoice,
    ChatDelta,
    ChunkWriter,
    CompletionChunkChoice,
    StreamHead,
)

CHAT_HEAD = StreamHead("chatcmpl-1", "chat.completion.chunk", 1700000000, "smollm2")
CHAT_PREFIX = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"smollm2","system_fingerprint":null,"choices":['
)


def test_chat_chunks_open_with_the_role_then_add_content_then_an_empty_delta() -> None:
    writer = ChunkWriter(CHAT_HEAD, include_usage=False)
    opening = ChatChunkChoice(0, ChatDelta(role="assistant", content=""))
    logprobs = {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]}]}
    content = ChatChunkChoice(1, ChatDelta(content="café"), logprobs)
    last = ChatChunkChoice(0, ChatDelta(), finish_reason="stop")

    assert writer.chunk(opening) == CHAT_PREFIX + (
        b'{"index":0,"delta":{"role":"assistant","content":"","refusal":null},'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert (
        writer.chunk(content)
        == CHAT_PREFIX
        + (
            '{"index":1,"delta":{"content":"café"},"logprobs":{"content":[{"token":"é",'
            '"logprob":-0.5,"bytes":[195,169]}]},"finish_reason":null}]}\n\n'
        ).encode()
    )
    assert writer.chunk(last) == CHAT_PREFIX + (
        b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\n'
    )


def test_completion_chunks_with_usage_carry_usage_null_and_end_with_the_usage() -> None:
    head = StreamHead("cmpl-1", "text_completion", 1700000000, "smollm2")
    writer = ChunkWriter(head, include_usage=True)
    usage = Usage(
        prompt_tokens=3,
        completion_tokens=2,
        total_tokens=5,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
    )
    prefix = (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,'
        b'"model":"smollm2","system_fingerprint":null,"choices":['
    )

    assert writer.chunk(CompletionChunkChoice(2, " world")) == prefix + (
        b'{"index":2,"text":" world","logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    )
    assert writer.chunk(CompletionChunkChoice(2, "", finish_reason="length")) == prefix + (
        b'{"index":2,"text":"","logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
    )
    assert writer.usage(usage) == prefix + (
        b'],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
    )


def test_chunk_text_is_escaped_as_json_and_left_unescaped_beyond_ascii() -> None:
    writer = ChunkWriter(CHAT_HEAD, include_usage=False)
    text = 'say "hi"\n\tback\\slash \u2028 café 😀 \x00'

    completion = writer.chunk(CompletionChunkChoice(0, text, {"tokens": ["é"]}, "stop"))
    chat = writer.chunk(ChatChunkChoice(0, ChatDelta(content=text)))

    for chunk in (completion, chat):
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        assert "café 😀".encode() in chunk
    (choice,) = json.loads(completion[6:])["choices"]
    assert choice == {
        "index": 0,
        "text": text,
        "logprobs": {"tokens": ["é"]},
        "finish_reason": "stop",
    }
    assert json.loads(chat[6:])["choices"][0]["delta"] == {"content": text}
