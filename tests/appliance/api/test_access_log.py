"""The access log of real requests through the server: one line each, with the method, route
template, status, latency, caller and audit entry, and nothing of the request's content."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.auth.roles import Role
from appliance.config import LogSettings
from appliance.engine.engine import Engine
from appliance.logs import JsonFormatter
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server

ACCESS_LOGGER = "appliance.api.access_log"
SECRET_PROMPT = "My passport number is X9-QUOKKA-4417."


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("access-log"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running


def _access_records(caplog: pytest.LogCaptureFixture, expected: int = 0) -> list[logging.LogRecord]:
    """The access log's records, once there are `expected` of them: a line is written as its
    response ends, which the client may see a moment before."""
    deadline = time.monotonic() + 10
    while True:
        records = [record for record in caplog.records if record.name == ACCESS_LOGGER]
        if len(records) >= expected or time.monotonic() > deadline:
            return records
        time.sleep(0.01)


def test_a_chat_request_is_logged_with_its_route_status_caller_and_entry_not_its_content(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    token = server.token(Role.USER, "alice")
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        "max_tokens": 4,
    }
    with server.http(role=None) as http:
        response = http.post(
            "/v1/chat/completions?api_key=query-secret",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
        )
    assert response.status_code == 200
    completion = response.json()["choices"][0]["message"]["content"]
    [record] = _access_records(caplog, 1)
    fields = record.fields  # type: ignore[attr-defined]
    entry_index = int(response.headers["audit-entry"].split(" ")[1])
    assert fields == {
        "method": "POST",
        "route": "/v1/chat/completions",
        "status": 200,
        "latency_ms": fields["latency_ms"],
        "issuer": "urn:inferno:local-issuer",
        "subject": "alice",
        "audit_entry": entry_index,
    }
    assert fields["latency_ms"] > 0
    line = json.loads(JsonFormatter().format(record))
    assert line["logger"] == ACCESS_LOGGER and line["level"] == "INFO"
    assert {key: line[key] for key in fields} == fields
    text = record.getMessage()
    assert text.startswith("POST /v1/chat/completions 200 ")
    assert "subject=alice" in text and f"audit_entry={entry_index}" in text
    for secret in (SECRET_PROMPT, token, "query-secret", completion):
        assert secret not in text
        assert secret not in json.dumps(line)


def test_refusals_and_unknown_paths_are_logged_without_a_caller_or_the_path_sent(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with server.http(role=None) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.get("/v1/audit/proof/0").status_code == 401
        assert http.get("/no/such/path-with-a-secret").status_code == 404
        assert http.get("/health").status_code == 200
    logged = [
        (f["method"], f["route"], f["status"], f["subject"])
        for f in (record.fields for record in _access_records(caplog, 4))  # type: ignore[attr-defined]
    ]
    assert logged == [
        ("GET", "/v1/models", 401, None),
        ("GET", "/v1/audit/proof/{index}", 401, None),
        ("GET", None, 404, None),
        ("GET", "/health", 200, None),
    ]
    assert not any("path-with-a-secret" in record.getMessage() for record in caplog.records)


def test_log_access_false_writes_no_access_log(
    api_engine: Engine,
    smollm2_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    settings = make_settings(tmp_path, smollm2_dir)
    quiet = settings.model_copy(update={"log": LogSettings(access=False)})
    with running_server(quiet, api_engine) as running, running.http() as http:
        assert http.get("/v1/models").status_code == 200
    assert _access_records(caplog) == []  # the server stopped: any line is written by now
