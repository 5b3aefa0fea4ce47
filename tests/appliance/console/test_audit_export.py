"""The console's audit export over HTTP against the real TLS server: the downloaded bundle
verifies with the offline verifier, the export is recorded (naming the auditor who asked)
before the bundle is written and refused when the log cannot record it, every bad range is a
400 page that records nothing, and the SIEM panel says it is not configured and how to feed one."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.auth.roles import Role
from appliance.console import audit_export
from appliance.engine.engine import Engine
from audit.__main__ import main as audit_main
from audit.errors import AuditWriteError
from tests.appliance.api.conftest import RunningServer, make_settings, running_server
from tests.appliance.console.test_routes import browser, entries, sign_in


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("export"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running


def test_an_auditor_exports_a_bundle_that_verifies_offline_recorded_first(
    server: RunningServer, tmp_path: Path
) -> None:
    auditor = sign_in(server, Role.AUDITOR, "exporter")
    with browser(server, auditor) as http:
        page = http.get("/console/export")
        assert page.status_code == 200 and "Export bundle" in page.text
        form = {"csrf_token": auditor.csrf_token, "first_index": "1", "last_index": "2"}
        download = http.post("/console/export", data=form)
    assert download.status_code == 200, download.text
    assert download.headers["content-type"] == "application/x-tar"
    disposition = download.headers["content-disposition"]
    assert disposition.startswith("attachment;") and ".tar" in disposition
    bundle = tmp_path / "bundle.tar"
    bundle.write_bytes(download.content)
    vkey = server.app.state.audit_trail.log.vkey
    assert audit_main(["verify", str(bundle), "--vkey", vkey]) == 0
    with tarfile.open(bundle) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        lines = tar.extractfile("entries.jsonl").read().splitlines()  # type: ignore[union-attr]
    assert manifest["first_index"] == 1
    logged = entries(server)
    asked = [e for e in logged if e["action"] == "admin.audit.export"][-1]
    done = logged[manifest["export_entry"]]
    assert done["action"] == "audit.export"
    for entry in (asked, done):
        assert entry["actor"]["subject"] == "exporter" and entry["actor"]["roles"] == ["auditor"]
    assert asked["details"]["target"]["first_index"] == 1
    assert asked["index"] < done["index"]  # recorded before the export ran
    assert json.loads(lines[0])["index"] == 1


def test_a_time_range_exports_the_entries_logged_in_it(
    server: RunningServer, tmp_path: Path
) -> None:
    admin = sign_in(server, Role.ADMIN)
    first = entries(server)[0]["time"][:16]  # minutes, as the form's fields give them
    with browser(server, admin) as http:
        form = {"csrf_token": admin.csrf_token, "since": first}
        download = http.post("/console/export", data=form)
    assert download.status_code == 200, download.text
    (tmp_path / "all.tar").write_bytes(download.content)
    vkey = server.app.state.audit_trail.log.vkey
    assert audit_main(["verify", str(tmp_path / "all.tar"), "--vkey", vkey]) == 0


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"first_index": "one"}, "first_index must be an entry number"),
        ({"last_index": "-1"}, "last_index must be an entry number"),
        ({"first_index": "5", "last_index": "2"}, "the last index comes before the first"),
        ({"first_index": "99999999"}, "it has no entry 99999999"),
        ({"since": "last tuesday"}, "since must be a time like"),
        ({"since": "2026-11-25T10:00", "until": "2026-11-25T09:00"}, "since must not come after"),
        ({"first_index": "0", "since": "2026-11-25T10:00"}, "not both"),
        ({"since": "2001-01-01T00:00", "until": "2001-01-02T00:00"}, "no entries were logged"),
    ],
)
def test_a_bad_range_is_a_400_page_that_records_nothing(
    server: RunningServer, form: dict[str, str], message: str
) -> None:
    admin = sign_in(server, Role.ADMIN)
    size = server.app.state.audit_trail.log.store.size()
    with browser(server, admin) as http:
        refused = http.post("/console/export", data={"csrf_token": admin.csrf_token, **form})
    assert refused.status_code == 400
    assert refused.headers["content-type"].startswith("text/html")
    assert message in refused.text
    assert server.app.state.audit_trail.log.store.size() == size  # nothing was recorded


def test_a_range_over_the_limit_is_refused(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_export, "MAX_EXPORT_ENTRIES", 2)
    admin = sign_in(server, Role.ADMIN)
    with browser(server, admin) as http:
        refused = http.post("/console/export", data={"csrf_token": admin.csrf_token})
    assert refused.status_code == 400
    assert "exports at most 2 at a time" in refused.text


def test_an_export_the_log_cannot_record_is_refused(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(event: object) -> None:
        raise AuditWriteError("disk full")

    monkeypatch.setattr(server.app.state.console.trail, "append", refuse)
    auditor = sign_in(server, Role.AUDITOR)
    before = [e for e in entries(server) if e["action"] == "audit.export"]
    with browser(server, auditor) as http:
        refused = http.post("/console/export", data={"csrf_token": auditor.csrf_token})
    assert refused.status_code == 503 and "was not done" in refused.text
    assert [e for e in entries(server) if e["action"] == "audit.export"] == before


def test_export_needs_a_csrf_token_and_a_console_viewer(server: RunningServer) -> None:
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        assert http.post("/console/export", data={}).status_code == 403
    user = sign_in(server, Role.USER)
    with browser(server, user) as http:
        assert http.get("/console/export").status_code == 403
        assert http.post("/console/export", data={"csrf_token": user.csrf_token}).status_code == 403


def test_the_siem_panel_says_it_is_not_configured_and_how_to_feed_one(
    server: RunningServer,
) -> None:
    with browser(server, sign_in(server, Role.AUDITOR)) as http:
        page = http.get("/console/export")
        audit = http.get("/console/audit")
    siem = page.text.split("<h2>SIEM feed</h2>", 1)[1]
    assert "Not configured" in siem and "python -m audit siem" in siem
    assert 'href="/console/export"' in audit.text  # reached from the audit page


def test_a_body_that_is_not_the_form_is_refused_without_exporting(server: RunningServer) -> None:
    admin = sign_in(server, Role.ADMIN)
    size = server.app.state.audit_trail.log.store.size()
    with browser(server, admin) as http:
        refused = http.post("/console/export", json={}, headers={"X-CSRF-Token": admin.csrf_token})
    assert refused.status_code == 400 and "this takes the page" in refused.text
    assert server.app.state.audit_trail.log.store.size() == size
