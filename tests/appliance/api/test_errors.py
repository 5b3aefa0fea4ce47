"""Bad requests get OpenAI's error shape with the right status, and never disturb the requests
in flight. The server here admits 2 sequences at once and bodies up to 64 KiB."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appliance.engine.engine import Engine
from tests.appliance.api.conftest import (
    AUDIT_ORIGIN,
    MODEL_NAME,
    RunningServer,
    make_settings,
    running_server,
    wait_until_idle,
)

MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(
        tmp_path_factory.mktemp("tls"),
        smollm2_dir,
        max_concurrent_requests=2,
        max_request_body_bytes=MAX_BODY,
        retry_after_s=3,
    )
    with running_server(settings, api_engine) as running:
        yield running


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    # Refused or not, the request is in the audit log, and the response says where.
    assert response.headers["audit-entry"].startswith(f"{AUDIT_ORIGIN} ")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_malformed_json_is_a_400(http: httpx.Client) -> None:
    response = http.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"]


def test_body_that_is_not_an_object_is_a_400(http: httpx.Client) -> None:
    error = _error(http.post(CHAT, json=[1, 2]), 400)
    assert "JSON object" in error["message"]


def test_field_of_the_wrong_type_names_the_field(http: httpx.Client) -> None:
    error = _error(http.post(CHAT, json={"model": MODEL_NAME, "messages": HI, "n": "two"}), 400)
    assert error["param"] == "n"
    assert "'n'" in error["message"]


def test_unknown_field_is_refused_by_name(http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "messages": HI, "frequency_penality": 0.5}
    error = _error(http.post(CHAT, json=body), 400)
    assert error["message"] == "Unrecognized request argument supplied: frequency_penality"
    assert error["param"] == "frequency_penality"


def test_missing_field_is_named(http: httpx.Client) -> None:
    error = _error(http.post(CHAT, json={"model": MODEL_NAME}), 400)
    assert error["param"] == "messages"


LONE_SURROGATE = "\ud800"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            CHAT,
            {"messages": [{"role": "user", "content": f"Hi {LONE_SURROGATE}"}]},
            "messages.0.content",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}]},
            "messages.0.content",
        ),
        (CHAT, {"messages": HI, "stop": LONE_SURROGATE}, "stop"),
        ("/v1/completions", {"prompt": f"a{LONE_SURROGATE}b"}, "prompt"),
    ],
    ids=["chat-content", "chat-content-part", "stop", "completion-prompt"],
)
def test_text_with_an_unpaired_surrogate_is_a_400_naming_the_field(
    http: httpx.Client, route: str, body: dict[str, Any], param: str
) -> None:
    # json.dumps escapes the surrogate as \ud800, valid JSON that decodes to no valid Unicode.
    payload = json.dumps({"model": MODEL_NAME, **body})
    response = http.post(route, content=payload, headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["param"] == param
    assert param is None or param in error["message"]
    assert "unpaired UTF-16 surrogate" in error["message"]
    ok = http.post(CHAT, json={"model": MODEL_NAME, "messages": HI, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_unknown_model_is_a_404_model_not_found(http: httpx.Client) -> None:
    error = _error(http.post(CHAT, json={"model": "gpt-4", "messages": HI}), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    _error(http.get("/v1/models/gpt-4"), 404)


def test_unknown_path_is_a_404_in_openai_shape(http: httpx.Client) -> None:
    error = _error(http.post("/v1/embeddings", json={}), 404)
    assert "/v1/embeddings" in error["message"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", CHAT])
def test_context_overflow_is_a_400_context_length_exceeded(
    http: httpx.Client, endpoint: str
) -> None:
    long_text = "word " * 600  # over the 512-token context
    if endpoint == CHAT:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": long_text}]}
        param = "messages"
    else:
        body, param = {"model": MODEL_NAME, "prompt": long_text}, "prompt"
    error = _error(http.post(endpoint, json=body), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    assert "shorten the prompt" in error["message"]
    assert "word" not in error["message"], "error messages never quote the prompt"


def test_declared_body_over_the_limit_is_a_413(http: httpx.Client) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "x" * MAX_BODY}).encode()
    error = _error(http.post("/v1/completions", content=body), 413)
    assert str(MAX_BODY) in error["message"]


def test_chunked_body_over_the_limit_is_a_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    _error(http.post("/v1/completions", content=chunks()), 413)


def test_a_response_format_schema_that_cannot_compile_is_a_clear_400(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": MODEL_NAME, "messages": HI, "response_format": response_format}
    error = _error(http.post(CHAT, json=body), 400)
    assert error["param"] == "response_format.json_schema.schema"
    assert "the JSON schema cannot be compiled" in error["message"]
    assert "nowhere" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": HI, "temperature": 3.0}, "temperature"),
        ({"messages": HI, "n": 3}, "n"),  # more than the 2 sequences this server runs at once
        ({"prompt": "Hi", "suffix": "end"}, "suffix"),
        ({"prompt": "Hi", "best_of": 3}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], [70000]]}, None),
        ({"messages": HI, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": "Hi", "presence_penalty": -3}, "presence_penalty"),
        ({"messages": HI, "presence_penalty": float("nan")}, "presence_penalty"),
        ({"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": HI, "repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"messages": HI, "logit_bias": {"42": 101}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {"forty-two": 1}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {"70000": 1}}, "logit_bias"),  # past the vocabulary
        ({"prompt": "Hi", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "Hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "Hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"prompt": "Hi", "stop_token_ids": [70000]}, "stop_token_ids"),
        ({"messages": HI, "store": True}, "store"),
        ({"messages": HI, "metadata": {str(i): "x" for i in range(17)}}, "metadata"),
        ({"messages": HI, "metadata": {"k": "x" * 513}}, "metadata"),
    ],
)
def test_parameters_that_cannot_be_honoured_are_400s_naming_them(
    http: httpx.Client, body: dict[str, Any], param: str | None
) -> None:
    endpoint = CHAT if "messages" in body else "/v1/completions"
    # json.dumps writes NaN and Infinity as Python's JSON parser (the server's) reads them.
    payload = json.dumps({"model": MODEL_NAME, **body})
    response = http.post(endpoint, content=payload, headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["param"] == param
    assert param is None or param in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"walrus-ticket": 1}),
        ("logit_bias", {"walrus-ticket": 500}),
        ("metadata", {"walrus-ticket": "x" * 600}),
    ],
)
def test_a_bad_entry_of_a_client_keyed_object_is_named_by_the_field_not_its_key(
    http: httpx.Client, field: str, value: dict[str, Any]
) -> None:
    error = _error(http.post(CHAT, json={"model": MODEL_NAME, "messages": HI, field: value}), 400)
    assert error["param"] == field
    assert "walrus" not in error["message"]


def test_full_server_answers_429_with_retry_after_then_recovers(
    server: RunningServer, http: httpx.Client
) -> None:
    client = server.client()
    long = {"max_tokens": 400, "extra_body": {"ignore_eos": True}, "stream": True}
    first = client.chat.completions.create(model=MODEL_NAME, messages=HI, **long)
    second = client.chat.completions.create(model=MODEL_NAME, messages=HI, **long)
    next(iter(first)), next(iter(second))
    response = http.post(CHAT, json={"model": MODEL_NAME, "messages": HI, "max_tokens": 1})
    error = _error(response, 429)
    assert response.headers["retry-after"] == "3"
    assert error["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
    first.close()
    second.close()
    wait_until_idle(server.engine)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_errors_do_not_disturb_a_request_in_flight(
    server: RunningServer, http: httpx.Client
) -> None:
    client = server.client()
    params = {"model": MODEL_NAME, "messages": HI, "max_tokens": 24, "temperature": 0}
    expected = client.chat.completions.create(**params).choices[0].message.content
    stream = client.chat.completions.create(**params, stream=True)
    parts = []
    for i, chunk in enumerate(stream):
        parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if i == 2:
            _error(http.post(CHAT, content=b"{", headers={"content-type": "application/json"}), 400)
            _error(http.post(CHAT, json={"model": "other", "messages": HI}), 404)
            _error(http.post(CHAT, json={"model": MODEL_NAME, "messages": HI, "n": 9}), 400)
            _error(http.post("/v1/completions", content=b"x" * (MAX_BODY + 1)), 413)
            long_prompt = {"model": MODEL_NAME, "prompt": "word " * 600}
            _error(http.post("/v1/completions", json=long_prompt), 400)
    assert "".join(parts) == expected


def test_every_response_carries_the_tee_state_header(http: httpx.Client) -> None:
    responses = [
        http.get("/v1/models"),
        http.get("/health"),
        http.post(CHAT, json={"model": "other", "messages": HI}),
        http.post("/v1/completions", content=b"x" * (MAX_BODY + 1)),
        http.get("/nowhere"),
    ]
    assert [r.headers["x-inferno-tee"] for r in responses] == ["UNVERIFIED"] * len(responses)
