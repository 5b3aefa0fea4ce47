"""The shared request path's stream of writes (appliance.api.serving): what is ready together
goes out in one write, every event of it intact and in order; and the per-request work before
it (a completion's prompt decoded only when its text is read)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from appliance.api.completions import _CompletionEndpoint, _CompletionOutput
from appliance.api.generation import Choice
from appliance.api.schemas import CompletionRequest, PromptTokensDetails, Usage
from appliance.api.serving import _events
from appliance.api.streaming import DONE, ChunkWriter, StreamHead
from appliance.engine.outputs import RequestOutput
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.sequence import RequestId
from appliance.engine.tokenizer import Tokenizer

USAGE = Usage(
    prompt_tokens=2,
    completion_tokens=4,
    total_tokens=6,
    prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
)


def _output(text: str, token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=RequestId("cmpl-1-0"),
        text=text,
        token_ids=token_ids,
        logprobs=None,
        prompt_logprobs=None,
        finish_reason=finish_reason,
        stop_reason=None,
        num_prompt_tokens=2,
        num_output_tokens=token_ids[-1],
        num_cached_tokens=0,
    )


class _Generation:
    """The outputs of one choice, as `Generation.outputs` hands them on."""

    def __init__(self, outputs: list[RequestOutput]):
        self._outputs = outputs

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for out in self._outputs:
            yield 0, out

    def usage(self) -> Usage:
        return USAGE


def _events_of(write: bytes) -> list[dict]:
    """The events of one write, each a whole `data: <JSON>` event."""
    assert write.endswith(b"\n\n")
    events = write.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: {") for e in events)
    return [json.loads(e[len(b"data: ") :]) for e in events]


def test_the_tokens_of_a_merged_output_and_its_finish_go_out_in_one_write_in_order(
    smollm2_dir: Path,
) -> None:
    # The second output is what AsyncEngine gives a stream that fell behind: two outputs of a
    # step each, merged, the last one finished.
    ready = _output(" c", [3]).followed_by(_output(" d", [4], finish_reason="length"))
    generation = _Generation([_output(" a b", [1, 2]), ready])
    choice = Choice(0, 0, [5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    tokenizer = Tokenizer.from_model_dir(smollm2_dir)
    output = _CompletionOutput(tokenizer, [choice], [""], echo=False, with_logprobs=False)
    writer = ChunkWriter(StreamHead("cmpl-1", "text_completion", 1, "m"), include_usage=True)

    async def writes() -> list[bytes]:
        return [w async for w in _events(generation, writer, output)]  # type: ignore[arg-type]

    first, merged, usage, done = asyncio.run(writes())
    assert [c["choices"] for c in _events_of(first)] == [
        [{"index": 0, "text": " a b", "logprobs": None, "finish_reason": None}]
    ]
    assert [c["choices"] for c in _events_of(merged)] == [
        [{"index": 0, "text": " c d", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
    ]
    assert all(c["usage"] is None for c in _events_of(first) + _events_of(merged))
    assert _events_of(usage)[0]["usage"]["completion_tokens"] == 4
    assert done == DONE


class _CountingTokenizer:
    """A tokenizer that counts its decodes (the completion output's only use of it here)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids: list[int], **kwargs) -> str:
        self.decodes += 1
        return self._tokenizer.decode(ids, **kwargs)


def test_a_completion_of_token_ids_decodes_its_prompt_only_for_echo_or_logprobs(
    smollm2_dir: Path,
) -> None:
    """Only echo and the log-probabilities' text offsets read a prompt's text: a prompt of ids
    is not decoded otherwise (it would be work on the event loop for every request)."""
    tokenizer = _CountingTokenizer(Tokenizer.from_model_dir(smollm2_dir))
    choice = Choice(0, 0, [5, 6, 7], SamplingParams(max_tokens=4))
    for extra, decodes in [({}, 0), ({"echo": True}, 1), ({"logprobs": 1}, 1)]:
        body = CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=4, **extra)
        before = tokenizer.decodes
        output = _CompletionEndpoint(body).output(tokenizer, [choice])  # type: ignore[arg-type]
        assert tokenizer.decodes - before == decodes, extra
        expected = tokenizer._tokenizer.decode([5, 6, 7], skip_special_tokens=False)
        assert output.prompt_texts == ([expected] if decodes else [])
