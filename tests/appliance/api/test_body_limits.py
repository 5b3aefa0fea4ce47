"""Request bodies within their limits, through the app in-process (issue 13, defect 2): a JSON
body nested 100,000 levels deep gets a 400 saying so, in OpenAI's error shape and logged, never a
500 or a RecursionError; brackets inside strings do not count; a body over the size limit gets
413."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from appliance.app import build
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.roles import Role
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel
from appliance.engine.engine import Engine
from appliance.json_limits import MAX_NESTING_DEPTH
from tests.appliance.api.conftest import AUDIT_ORIGIN, MODEL_NAME, make_settings, weights_digest

DEEP = 100_000
MAX_BODY = 1 << 20
TOO_DEEP = f"the request body nests JSON arrays and objects deeper than {MAX_NESTING_DEPTH} levels"


@pytest.fixture(scope="module")
def client(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    settings = make_settings(
        tmp_path_factory.mktemp("body-limits"), smollm2_dir, max_request_body_bytes=MAX_BODY
    )
    model = LoadedModel(api_engine, weights_digest(smollm2_dir))
    app = build(settings, start_audit_log(settings), model=model)
    issuer = LocalIssuer.from_settings(settings.auth)
    assert issuer is not None
    token = issuer.mint(Role.USER, "body-limits", time.time())
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as test_client:
        yield test_client


def _error(response: Any, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["audit-entry"].startswith(f"{AUDIT_ORIGIN} ")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"model": "m", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", "application/json"),
        (b'{"a": ' * DEEP + b"1" + b"}" * DEEP, "application/json; charset=utf-8"),
        (b"[" * DEEP + b"]" * DEEP, None),  # FastAPI parses a body without a type as JSON
        (("[" * DEEP + "]" * DEEP).encode("utf-16-le"), "application/json"),  # json.loads reads it
    ],
)
def test_a_body_100000_levels_deep_is_a_400_saying_so(
    client: TestClient, body: bytes, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post("/v1/chat/completions", content=body, headers=headers)
    assert _error(response, 400).startswith(TOO_DEEP)


def test_brackets_inside_strings_do_not_count(client: TestClient) -> None:
    body = {"model": MODEL_NAME, "prompt": "[{" * 100, "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_a_body_over_the_size_limit_is_a_413(client: TestClient) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "x" * MAX_BODY}).encode()
    response = client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert "larger than the server's limit" in _error(response, 413)
