"""The OpenAPI schema says what the server does (issue 13, defect 5): its bounds are the ones
enforced, every status a route answers is documented with the media type it is sent in, and
request fields are typed strictly (a number is a JSON number, a flag a JSON boolean)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.appliance.api.conftest import MODEL_NAME, RunningServer

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def openapi(server: RunningServer) -> dict[str, Any]:
    with server.http(None) as http:
        return http.get("/openapi.json").json()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


def test_the_seed_bound_is_the_exact_integer_the_server_enforces(
    openapi: dict[str, Any], http: httpx.Client
) -> None:
    [seed_schema, _] = openapi["components"]["schemas"]["ChatCompletionRequest"]["properties"][
        "seed"
    ]["anyOf"]
    bound = seed_schema["exclusiveMaximum"]
    assert type(bound) is int and bound == 2**63
    body = {"model": MODEL_NAME, "messages": HI, "max_tokens": 1, "seed": bound - 1}
    assert http.post(CHAT, json=body).status_code == 200
    assert http.post(CHAT, json={**body, "seed": bound}).status_code == 400


def test_every_documented_error_is_json_as_it_is_sent(openapi: dict[str, Any]) -> None:
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    assert set(response.get("content", {})) == {"application/json"}, (
                        f"{method} {path} {status}"
                    )


def test_proof_of_a_malformed_or_negative_index_is_a_documented_400(
    openapi: dict[str, Any], http: httpx.Client
) -> None:
    assert "400" in openapi["paths"]["/v1/audit/proof/{index}"]["get"]["responses"]
    for index in ("x", "-1"):
        response = http.get(f"/v1/audit/proof/{index}")
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "index"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("max_tokens", 5.0),
        ("n", "1"),
        ("seed", False),
        ("temperature", "0.5"),
        ("temperature", True),
        ("stream", "true"),
        ("stream", 0),
        ("logprobs", 1),
        ("frequency_penalty", "0.5"),
        ("presence_penalty", True),
        ("min_tokens", 1.0),
        ("logit_bias", {"42": "1"}),
        ("store", "false"),
    ],
)
def test_a_field_of_another_json_type_is_refused_not_converted(
    http: httpx.Client, field: str, value: object
) -> None:
    body = {"model": MODEL_NAME, "messages": HI, "max_tokens": 1, field: value}
    response = http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_an_integer_is_a_number_where_a_float_is_expected(http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "messages": HI, "max_tokens": 1, "temperature": 0, "top_p": 1}
    assert http.post(CHAT, json=body).status_code == 200
