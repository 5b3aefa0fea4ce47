"""The API as users drive it: OpenAI's own Python client against the real server (uvicorn, TLS,
a loopback socket) on the embedded model."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import torch

from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server

QUESTION = "Name a famous painting by Leonardo da Vinci."
PLAIN_PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    [model] = client.models.list().data
    assert model.id == MODEL_NAME
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


@pytest.mark.slow
def test_greedy_chat_equals_inferno_generate_for_the_same_prompt(
    client: openai.OpenAI, smollm2_dir: Path
) -> None:
    generated = subprocess.run(
        [sys.executable, "-m", "appliance", "generate", "--model", str(smollm2_dir),
         "--prompt", QUESTION, "--chat", "--max-tokens", "24", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    reply = _chat(client, temperature=0, max_tokens=24)
    assert generated
    assert reply.choices[0].message.content == generated


def test_chat_reply_reports_usage_and_finish_reason(client: openai.OpenAI, server) -> None:
    reply = _chat(client, temperature=0, max_tokens=8)
    tokenizer = server.engine.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    [choice] = reply.choices
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == len(prompt) + 8
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL_NAME


def test_streamed_chat_adds_up_to_the_whole_reply_and_ends_with_usage(
    client: openai.OpenAI,
) -> None:
    whole = _chat(client, temperature=0, max_tokens=20).choices[0].message.content
    chunks = list(
        _chat(
            client,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None for c in middle)
    assert "".join(c.choices[0].delta.content for c in middle) == whole
    assert finish.choices[0].finish_reason is not None
    assert usage.choices == []
    assert usage.usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stop_string_truncates_whole_and_streamed_replies(client: openai.OpenAI) -> None:
    whole = _chat(client, temperature=0, max_tokens=24).choices[0].message.content
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    expected = whole[: whole.index(stop)]
    reply = _chat(client, temperature=0, max_tokens=24, stop=[stop, "never appears"])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = _chat(client, temperature=0, max_tokens=24, stop=stop, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == expected


def test_sdk_sampling_controls_are_accepted_and_reach_the_sampler(
    client: openai.OpenAI, server: RunningServer
) -> None:
    [purple] = server.engine.tokenizer.encode(" purple", add_special_tokens=False)
    reply = _chat(
        client,
        temperature=0,
        max_tokens=3,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={str(purple): 100},
        store=False,
        metadata={"team": "search"},
    )
    assert reply.choices[0].message.content.split() == ["purple"] * 3
    prompt = "Numbers: 1, 2,"
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    penalized = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.3},
    )
    assert penalized.choices[0].text != plain.choices[0].text


def test_stop_token_ids_end_after_min_tokens_with_finish_reason_stop(
    client: openai.OpenAI, server: RunningServer
) -> None:
    [purple] = server.engine.tokenizer.encode(" purple", add_special_tokens=False)
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PLAIN_PROMPT,
        max_tokens=10,
        temperature=0,
        logit_bias={str(purple): 100},
        extra_body={"stop_token_ids": [purple], "min_tokens": 2},
    )
    [choice] = reply.choices
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens == 3
    assert choice.text and "purple" not in choice.text


def test_chat_logprobs_describe_each_greedy_token(client: openai.OpenAI) -> None:
    reply = _chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    streamed = [
        e
        for c in _chat(client, temperature=0, max_tokens=10, logprobs=True, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


def test_n_choices_with_a_seed_are_distinct_and_reproducible(client: openai.OpenAI) -> None:
    def sample():
        return _chat(
            client, n=3, seed=7, temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True}
        )

    first, again = sample(), sample()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) == 3
    # The prompt counts once; each choice generated all 12 tokens (EOS ignored).
    assert first.usage.prompt_tokens == _chat(client, max_tokens=1).usage.prompt_tokens
    assert first.usage.completion_tokens == 3 * 12


def test_streamed_n_choices_each_complete(client: openai.OpenAI) -> None:
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in _chat(client, n=2, seed=3, temperature=1.0, max_tokens=10, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    whole = _chat(client, n=2, seed=3, temperature=1.0, max_tokens=10)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


def test_completion_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PLAIN_PROMPT, max_tokens=12, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PLAIN_PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert whole.choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 12


def test_completion_of_a_batch_of_token_id_prompts_numbers_choices_by_prompt(
    client: openai.OpenAI, server: RunningServer
) -> None:
    tokenizer = server.engine.tokenizer
    prompts = [tokenizer.encode(PLAIN_PROMPT), tokenizer.encode("Two plus two equals")]
    batch = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone.choices[0].text
    assert batch.usage.prompt_tokens == sum(map(len, prompts))
    assert batch.usage.completion_tokens == 4 * 6


def test_completion_stop_string_and_echo(client: openai.OpenAI) -> None:
    whole = (
        client.completions.create(
            model=MODEL_NAME, prompt=PLAIN_PROMPT, max_tokens=12, temperature=0
        )
        .choices[0]
        .text
    )
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PLAIN_PROMPT, max_tokens=12, temperature=0, stop=stop, echo=True
    ).choices[0]
    assert stopped.text == PLAIN_PROMPT + whole[: whole.index(stop)]
    assert stopped.finish_reason == "stop"


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_echoed_prompt_logprobs_agree_with_transformers(
    client: openai.OpenAI, server: RunningServer, hf_model, stream: bool
) -> None:
    prompt = "The capital of France is Paris, and the capital of Italy is"
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=3,
        stream=stream,
    )  # fmt: skip
    if stream:
        [first, _finish] = list(response)
        logprobs = first.choices[0].logprobs
        assert first.choices[0].text.startswith(prompt)
    else:
        logprobs = response.choices[0].logprobs
        assert response.choices[0].text.startswith(prompt)
    ids = server.engine.tokenizer.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    num_prompt = len(ids)
    assert len(logprobs.tokens) == num_prompt + 1  # the prompt, then the one generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[:num_prompt]) == prompt
    for pos in range(1, num_prompt):
        assert logprobs.token_logprobs[pos] == pytest.approx(
            ref[pos - 1, ids[pos]].item(), abs=1e-4
        )
        top = ref[pos - 1].topk(3)
        expected = {
            server.engine.tokenizer.decode([t]): v
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        }
        assert logprobs.top_logprobs[pos].keys() == expected.keys()
        for token, value in expected.items():
            assert logprobs.top_logprobs[pos][token] == pytest.approx(value, abs=1e-4)
    assert logprobs.text_offset[:3] == [
        0,
        len(logprobs.tokens[0]),
        len("".join(logprobs.tokens[:2])),
    ]
    # The generated token is the greedy continuation.
    assert logprobs.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)


@pytest.fixture(scope="module")
def bursting_server(
    smollm2_engine: Callable[..., Engine],
    smollm2_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    """The same model with decode bursts of 8 under asynchronous scheduling: each engine
    output, and so each streamed event, carries several tokens."""
    engine = smollm2_engine(
        max_model_len=512, num_kv_blocks=512, max_decode_burst=8, async_scheduling=True
    )
    settings = make_settings(tmp_path_factory.mktemp("tls-bursts"), smollm2_dir)
    with running_server(settings, engine) as running:
        yield running


def test_events_of_several_tokens_stream_what_the_whole_reply_holds(
    bursting_server: RunningServer,
) -> None:
    client = bursting_server.client()
    request = {"model": MODEL_NAME, "prompt": PLAIN_PROMPT, "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**request).choices[0]
    chunks = list(
        client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    # 16 tokens in bursts of up to 8: a handful of events, not one per token.
    assert len([c for c in chunks if c.choices and c.choices[0].text]) <= 6
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=16
    )
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=16, stream=True
    )
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == reply.choices[0].message.content
