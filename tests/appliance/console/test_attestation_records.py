"""The attestation's records in the console: the standing evidence downloaded by an auditor is
exactly the evidence the verdict's audit entry names by digest (recorded before the download),
the verdict history pages newest first through the audit log, and bad input or a TEE with no
evidence is answered with a page that says why."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from appliance.auth.roles import Role
from appliance.console import attestation_records
from appliance.engine.engine import Engine
from audit.canonical import canonicalize
from audit.event import Action, Outcome, system_event
from tests.appliance.api.conftest import RunningServer, make_settings, running_server
from tests.appliance.console.attested import attested_console
from tests.appliance.console.test_routes import browser, entries, sign_in


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """An insecure-dev appliance: nothing attested, one `skipped` verdict in the log."""
    settings = make_settings(tmp_path_factory.mktemp("records"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running


def test_an_auditor_downloads_the_evidence_the_verdict_names_recorded_first(
    tmp_path: Path, smollm2_dir: Path, api_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    console = attested_console(
        tmp_path, smollm2_dir, api_engine, monkeypatch, role=Role.AUDITOR, subject="inspector"
    )
    with console as (app, client, session):
        page = client.get("/console/attestation")
        assert "Download evidence" in page.text
        downloads = {}
        for part in ("all", "gpu", "cpu"):
            form = {"csrf_token": session.csrf_token, "part": part}
            download = client.post("/console/attestation/evidence", data=form)
            assert download.status_code == 200, download.text
            assert download.headers["content-disposition"].endswith(f'-{part}.json"')
            downloads[part] = download.json()
        bad = client.post("/console/attestation/evidence",
                          data={"csrf_token": session.csrf_token, "part": "tpm"})  # fmt: skip
        assert bad.status_code == 400 and "part must be one of all, gpu, cpu" in bad.text
        history = client.get("/console/attestation/history")
        store = app.state.audit_trail.log.store
        logged = [json.loads(data) for _, data in store.entries(0, store.size() - 1)]
    verdict = next(e for e in logged if e["action"] == "attestation.verdict")
    digest = "sha256:" + hashlib.sha256(canonicalize(downloads["all"])).hexdigest()
    assert digest == verdict["details"]["evidence_digest"]
    assert downloads["gpu"] == downloads["all"]["gpu"]
    assert downloads["cpu"] == downloads["all"]["cpu"]
    exports = [e for e in logged if e["action"] == "admin.attestation.evidence_export"]
    assert [e["details"]["target"]["part"] for e in exports] == ["all", "gpu", "cpu"]
    assert exports[0]["actor"]["subject"] == "inspector"
    assert exports[0]["details"]["target"]["evidence_digest"] == digest
    assert history.status_code == 200
    assert f"/console/audit/{verdict['index']}" in history.text and "trusted" in history.text


def test_the_history_pages_newest_first(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = server.app.state.audit_trail.log
    for trigger in ("reattest-a", "reattest-b", "reattest-c"):
        log.append(system_event(Action.ATTESTATION_VERDICT, time=datetime.now(UTC),
                                outcome=Outcome.SUCCESS,
                                details={"trigger": trigger, "result": "trusted"}))  # fmt: skip
    monkeypatch.setattr(attestation_records, "HISTORY_PAGE_SIZE", 2)
    verdicts = [e["index"] for e in entries(server) if e["action"] == "attestation.verdict"]
    shown, pages = [], []
    with browser(server, sign_in(server, Role.AUDITOR)) as http:
        page = http.get("/console/attestation/history")
        while True:
            assert page.status_code == 200
            pages.append(page.text)
            shown += [int(i) for i in re.findall(r'aria-label="Audit entry (\d+)"', page.text)]
            older = re.search(r'href="(/console/attestation/history\?before=\d+)"', page.text)
            if older is None:
                break
            page = http.get(older.group(1))
    assert shown == sorted(verdicts, reverse=True) and len(shown) == 4
    assert "reattest-c" in pages[0] and "skipped" in pages[1]  # insecure-dev's boot verdict
    assert "No older verdict" in pages[-1] or len(pages) == 2


@pytest.mark.parametrize("before", ["abc", "0", "-3", "1e3"])
def test_a_bad_history_position_is_a_400_page(server: RunningServer, before: str) -> None:
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        refused = http.get("/console/attestation/history", params={"before": before})
    assert refused.status_code == 400 and "before must be a positive entry number" in refused.text


def test_insecure_dev_has_no_evidence_to_download(server: RunningServer) -> None:
    auditor = sign_in(server, Role.AUDITOR)
    with browser(server, auditor) as http:
        page = http.get("/console/attestation")
        refused = http.post("/console/attestation/evidence",
                            data={"csrf_token": auditor.csrf_token})  # fmt: skip
        unsigned = http.post("/console/attestation/evidence", data={})
    assert 'href="/console/attestation/history"' in page.text
    assert "Download evidence" not in page.text
    assert refused.status_code == 409 and "no evidence" in refused.text
    assert unsigned.status_code == 403  # no CSRF token


def test_other_roles_cannot_see_the_records(server: RunningServer) -> None:
    user = sign_in(server, Role.USER)
    with browser(server, user) as http:
        assert http.get("/console/attestation/history").status_code == 403
        form = {"csrf_token": user.csrf_token}
        assert http.post("/console/attestation/evidence", data=form).status_code == 403
