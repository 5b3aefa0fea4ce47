"""Many clients at once, some of them leaving early: the rest are served correctly, every KV
block comes back, and the server keeps answering."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.appliance.api.conftest import MODEL_NAME, RunningServer, wait_until_idle

QUESTIONS = [
    "What is the capital of Japan?",
    "Name three fruits.",
    "Why is the sky blue?",
    "What is two plus three?",
    "Give me a synonym for happy.",
    "Who wrote Hamlet?",
    "What colour is grass?",
    "Name a planet.",
]
NUM_CLIENTS = 64
MAX_TOKENS = 12


def _params(question: str) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


@pytest.mark.slow
def test_64_streaming_clients_with_some_leaving_midway(server: RunningServer) -> None:
    sync_client = server.client()
    expected = {
        q: sync_client.chat.completions.create(**_params(q)).choices[0].message.content
        for q in QUESTIONS
    }
    wait_until_idle(server.engine)

    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, str]:
        question = QUESTIONS[i % len(QUESTIONS)]
        # A quarter of the clients leave at their first text, from requests that would
        # otherwise run far longer than the test waits.
        leaves = i % 4 == 3
        params = _params(question)
        if leaves:
            params.update(max_tokens=400, extra_body={"ignore_eos": True})
        stream = await client.chat.completions.create(**params, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if leaves and len(text) > 0:
                await stream.close()
                return question, None, text
        return question, finish, text

    async def run_all() -> list[tuple[str, str | None, str]]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(run_all())
    completed = [(q, finish, text) for q, finish, text in results if finish is not None]
    assert len(completed) == NUM_CLIENTS - NUM_CLIENTS // 4
    for question, finish, text in completed:
        assert finish in ("stop", "length")
        assert text == expected[question]
    # Every request, finished or abandoned, has released its KV blocks.
    wait_until_idle(server.engine, timeout_s=5.0)
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == NUM_CLIENTS // 4
    reply = sync_client.chat.completions.create(**_params(QUESTIONS[0]))
    assert reply.choices[0].message.content == expected[QUESTIONS[0]]


def test_client_that_gives_up_on_a_whole_response_aborts_its_request(
    server: RunningServer,
) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 500,  # many seconds of work on a CPU
        "ignore_eos": True,
    }
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    with server.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=0.5)
    wait_until_idle(server.engine, timeout_s=3.0)
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == 1
