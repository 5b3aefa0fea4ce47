"""The console's Usage page over HTTP against the real TLS server: a real completion's tokens
counted for its caller and role, admins only, a CSV download recorded before it is produced
(and refused when the log cannot record it) whose hostile cells are neutralised, and a 400 page
for every bad period, grouping or page."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from appliance.auth.roles import Role
from appliance.console import usage
from appliance.engine.engine import Engine
from audit.errors import AuditWriteError
from audit.event import Actor, Outcome, inference_complete
from tests.appliance.api.conftest import RunningServer, make_settings, running_server
from tests.appliance.console.test_routes import browser, entries, sign_in

HOSTILE = "=cmd|' /C calc'!A0"


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("usage"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        with running.client() as client:
            client.completions.create(model="smollm2", prompt="Hello", max_tokens=3)
        # A caller whose subject an identity provider let someone choose.
        running.app.state.audit_trail.log.append(
            inference_complete(
                time=datetime.now(UTC), actor=Actor("urn:idp", HOSTILE, None, ("service",)),
                source_address=None, request_id="r-1", outcome=Outcome.SUCCESS, model="smollm2",
                weights_digest="sha256:00", prompt_tokens=11, completion_tokens=4,
                finish_reason="stop", latency_ms=1.0, prompt_commitment="c",
                response_commitment="c",
            )
        )  # fmt: skip
        yield running


def completed(server: RunningServer, subject: str) -> dict[str, object]:
    return next(
        e for e in entries(server)
        if e["action"] == "inference.complete" and e["actor"]["subject"] == subject  # type: ignore[index]
    )  # fmt: skip


def test_usage_counts_a_real_completion_for_its_caller_and_role(server: RunningServer) -> None:
    details = completed(server, "test-user")["details"]
    tokens = details["prompt_tokens"] + details["completion_tokens"]  # type: ignore[index]
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        by_principal = http.get("/console/usage")
        by_role = http.get("/console/usage", params={"by": "role", "sort": "name"})
    assert by_principal.status_code == 200
    row = by_principal.text.split("<td>test-user</td>", 1)[1].split("</tr>", 1)[0]
    assert f"<td>{tokens}</td>" in row and "<td>1</td>" in row
    assert "<td>user</td>" in by_role.text and "<td>service</td>" in by_role.text
    assert 'href="/console/usage"' in by_principal.text  # in the admin's menu


def test_the_csv_is_recorded_first_and_neutralises_hostile_cells(server: RunningServer) -> None:
    admin = sign_in(server, Role.ADMIN, "accountant")
    with browser(server, admin) as http:
        page = http.get("/console/usage")
        since = page.text.split('name="since" value="', 1)[1].split('"', 1)[0]
        until = page.text.split('name="until" value="', 1)[1].split('"', 1)[0]
        form = {"csrf_token": admin.csrf_token, "since": since, "until": until}
        download = http.post("/console/usage/csv", data=form)
    assert download.status_code == 200
    assert download.headers["content-type"].startswith("text/csv")
    assert download.headers["content-disposition"].startswith('attachment; filename="usage-')
    rows = list(csv.reader(io.StringIO(download.text)))
    names = {(row[0], row[1]) for row in rows[1:]}
    assert {("principal", "test-user"), ("principal", "'" + HOSTILE)} <= names
    assert {("role", "user"), ("role", "service")} <= names
    assert not any(cell.startswith(("=", "+", "-", "@")) for row in rows for cell in row)
    recorded = [e for e in entries(server) if e["action"] == "admin.usage.export"][-1]
    assert recorded["actor"]["subject"] == "accountant"
    assert recorded["details"]["target"]["since"].startswith(since)


def test_a_csv_the_log_cannot_record_is_refused(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(event: object) -> None:
        raise AuditWriteError("disk full")

    monkeypatch.setattr(server.app.state.console.trail, "append", refuse)
    admin = sign_in(server, Role.ADMIN)
    with browser(server, admin) as http:
        refused = http.post("/console/usage/csv", data={"csrf_token": admin.csrf_token})
    assert refused.status_code == 503 and "was not done" in refused.text
    assert "text/csv" not in refused.headers["content-type"]


def test_usage_is_for_admins_only(server: RunningServer) -> None:
    auditor = sign_in(server, Role.AUDITOR)
    with browser(server, auditor) as http:
        page = http.get("/console/usage")
        download = http.post("/console/usage/csv", data={"csrf_token": auditor.csrf_token})
        audit = http.get("/console/audit")
    assert page.status_code == 403 and "needs the role admin" in page.text
    assert download.status_code == 403
    assert 'href="/console/usage"' not in audit.text


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"since": "noon"}, "since must be a time like"),
        ({"since": "2026-11-25T10:00", "until": "2026-11-25T09:00"}, "must come before"),
        ({"since": "2025-01-01T00:00", "until": "2026-01-01T00:00"}, "at most 31 days"),
        ({"by": "team"}, "by must be principal or role"),
        ({"page": "0"}, "page must be a number from 1 to 1"),
        ({"page": "7"}, "page must be a number from 1 to 1"),
        ({"page": "last"}, "page must be a number from 1 to 1"),
    ],
)
def test_bad_input_is_a_400_page(
    server: RunningServer, params: dict[str, str], message: str
) -> None:
    admin = sign_in(server, Role.ADMIN)
    with browser(server, admin) as http:
        refused = http.get("/console/usage", params=params)
        form = {"csrf_token": admin.csrf_token, **params}
        refused_csv = http.post("/console/usage/csv", data=form)
    assert refused.status_code == 400 and message in refused.text
    assert refused.headers["content-type"].startswith("text/html")
    if "page" not in params and "by" not in params:  # the CSV has neither
        assert refused_csv.status_code == 400 and message in refused_csv.text


def test_a_period_over_the_scan_limit_is_refused_not_undercounted(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage, "MAX_SCANNED", 3)
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        refused = http.get("/console/usage")
    assert refused.status_code == 400 and "more than the 3 one view reads" in refused.text


def test_an_empty_period_says_what_to_do(server: RunningServer) -> None:
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        page = http.get("/console/usage", params={"since": "2001-01-01T00:00",
                                                  "until": "2001-01-02T00:00"})  # fmt: skip
    assert page.status_code == 200
    assert "No inference request ended in this period" in page.text
