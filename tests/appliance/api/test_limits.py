"""Per-caller limits through the real server: the caller over a limit gets 429 with Retry-After,
a message naming the setting, an `api.limited` audit entry its response names, and a count on
/metrics; other callers are unaffected, and a request's place is given back when it ends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.auth.roles import Role
from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.test_audit_trail import AuditDatabase

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
LIMITS = {
    "subject_max_concurrent_requests": 1,
    "subject_requests_per_minute": 3,
    "role_tokens_per_minute": {"service": 20},
    "attestation_requests_per_minute": 2,
}


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("limits"), smollm2_dir, limits=LIMITS)
    with running_server(settings, api_engine) as running:
        yield running


def _chat(http: httpx.Client, max_tokens: int = 1) -> httpx.Response:
    return http.post(CHAT, json={"model": MODEL_NAME, "messages": HI, "max_tokens": max_tokens})


def _assert_limited(
    server: RunningServer, response: httpx.Response, setting: str, label: str
) -> None:
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert setting in error["message"]
    assert error["code"] == "rate_limit_exceeded"
    _, index, _ = response.headers["Audit-Entry"].split(" ")
    entry = AuditDatabase(server).entry(int(index))
    assert (entry["action"], entry["outcome"]) == ("api.limited", "denied")
    assert entry["details"]["limit"] == setting
    assert server.metric("inferno:limited_requests_total", limit=label) >= 1


def test_a_subject_over_its_requests_per_minute_is_refused_and_another_is_not(
    server: RunningServer,
) -> None:
    with server.http(Role.USER, "alice") as alice, server.http(Role.USER, "bob") as bob:
        for _ in range(3):
            assert _chat(alice).status_code == 200
        refused = _chat(alice)
        assert _chat(bob).status_code == 200
    _assert_limited(
        server, refused, "limits.subject_requests_per_minute", "subject_requests_per_minute"
    )
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    entry = AuditDatabase(server).entry(int(refused.headers["Audit-Entry"].split(" ")[1]))
    assert entry["actor"]["subject"] == "alice"


def test_a_subject_with_a_request_in_flight_waits_for_it_to_end(server: RunningServer) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": HI,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http(Role.USER, "carol") as carol:
        with carol.stream("POST", CHAT, json=body) as streaming:
            assert streaming.status_code == 200
            chunks = streaming.iter_bytes()  # held: a dropped iterator closes the stream
            next(chunks)
            refused = _chat(carol)
        _assert_limited(
            server,
            refused,
            "limits.subject_max_concurrent_requests",
            "subject_max_concurrent_requests",
        )
        # The closed stream gives its place back once the server sees the client leave.
        deadline = time.monotonic() + 10
        while (answer := _chat(carol)).status_code == 429:
            assert time.monotonic() < deadline, "the closed stream kept its place"
            time.sleep(0.1)
        assert answer.status_code == 200


def test_a_role_over_its_tokens_per_minute_refuses_all_its_callers_and_no_other_role(
    server: RunningServer,
) -> None:
    with (
        server.http(Role.SERVICE, "billing") as billing,
        server.http(Role.SERVICE, "search") as search,
        server.http(Role.USER, "dave") as dave,
    ):
        # Admitted while the role's budget is not spent; charged prompt plus completion tokens.
        assert _chat(billing, max_tokens=16).status_code == 200
        refused = _chat(search)
        assert _chat(dave).status_code == 200
    _assert_limited(
        server, refused, "limits.role_tokens_per_minute.service", "role_tokens_per_minute"
    )


def test_attestation_is_limited_per_source_address(server: RunningServer) -> None:
    nonce = "00" * 32
    with server.http(None) as anyone:
        # insecure-dev has nothing to attest (409), yet each request counts.
        statuses = [anyone.get("/v1/attestation", params={"nonce": nonce}) for _ in range(3)]
    assert [r.status_code for r in statuses[:2]] == [409, 409]
    _assert_limited(
        server,
        statuses[2],
        "limits.attestation_requests_per_minute",
        "attestation_requests_per_minute",
    )
