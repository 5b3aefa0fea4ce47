"""The console of an appliance whose TEE is attested (a scripted TEE,
tests/appliance/attestation/fake_tee.py): the Attestation page shows every check of the
verdict, no UNVERIFIED banner, and "re-attest now" is recorded before the re-attestation runs;
the Overview names the next re-attestation, then the failed checks once one failed."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from appliance.auth.roles import Role
from appliance.console.pages import format_utc
from appliance.engine.engine import Engine
from attestation.trust_bundle import format_created
from tests.appliance.attestation.fake_tee import FakeVerifier
from tests.appliance.console.attested import attested_console


def test_attestation_page_lists_the_checks_and_reattest_is_audited_first(
    tmp_path: Path, smollm2_dir: Path, api_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = FakeVerifier()  # passes at boot; a check fails once an admin re-attests
    console = attested_console(
        tmp_path,
        smollm2_dir,
        api_engine,
        monkeypatch,
        role=Role.ADMIN,
        subject="operator",
        verifier=verifier,
    )
    with console as (app, client, session):
        page = client.get("/console/attestation")
        assert page.status_code == 200
        assert "gpu0.signature" in page.text and "550.90.07" in page.text  # a check, a claim
        assert "<dt>Trust bundle</dt><dd>none</dd>" in page.text  # no collateral claims
        assert "UNVERIFIED" not in page.text and "VERIFIED" in page.text
        # The Overview names the next re-attestation, as the timer scheduled it.
        deadline_shown = app.state.tee.next_reattestation
        assert deadline_shown is not None
        overview = client.get("/console/").text
        assert re.search(r"Next re-attestation</dt>\s*<dd><time datetime=", overview)
        assert f"{format_utc(deadline_shown)}</time> (every 1 h" in overview
        assert "Failed checks" not in overview and "not sealed" in overview
        verifier.failures["cpu.tcb"] = "below the policy's minimum"
        deadline = time.monotonic() + 60
        form = {"csrf_token": session.csrf_token}
        done = client.post("/console/attestation/reattest", data=form, follow_redirects=False)
        assert done.status_code == 303
        assert done.headers["location"] == "/console/attestation?requested=1"
        while client.get("/health").json()["status"] != "failed":
            assert time.monotonic() < deadline, "the re-attestation never ran"
            time.sleep(0.02)
        overview = client.get("/console/").text
        assert "Failed checks" in overview and "<strong>cpu.tcb</strong>" in overview
        assert "none: a failed verdict stopped inference until restart" in overview
        assert app.state.tee.next_reattestation is None
        page = client.get("/console/attestation", params={"sort": "result"})
        assert "cpu.tcb" in page.text and "below the policy" in page.text
        history = page.text.split("<h2>History</h2>", 1)[1]
        assert history.count("<tr>") == 1 + 2  # the header, the boot's and the re-attestation's
        assert "reattest" in history and "not trusted" in history
        store = app.state.audit_trail.log.store
        entries = [json.loads(data) for _, data in store.entries(0, store.size() - 1)]
    actions = [(e["action"], e["actor"]["subject"]) for e in entries]
    requested = actions.index(("admin.tee.reattest", "operator"))
    verdicts = [i for i, (action, _) in enumerate(actions) if action == "attestation.verdict"]
    assert verdicts[0] < requested < verdicts[-1]


def test_attestation_page_shows_the_trust_bundle_and_its_age(
    tmp_path: Path, smollm2_dir: Path, api_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = datetime.now(UTC) - timedelta(days=3, hours=12)
    digest = "3f2a" * 16
    bundle = {"digest": digest, "created": format_created(created)}
    verifier = FakeVerifier(claims={"collateral": {"trust_bundle": bundle}})
    console = attested_console(tmp_path, smollm2_dir, api_engine, monkeypatch,
                               role=Role.AUDITOR, subject="auditor", verifier=verifier)  # fmt: skip
    with console as (_, client, _):
        page = client.get("/console/attestation").text
    shown = page.split("<dt>Trust bundle</dt><dd>", 1)[1].split("</dd>", 1)[0]
    assert f'<code class="digest">{digest}</code>' in shown
    assert f"{format_utc(created.replace(microsecond=0))}</time>, 3.5 days old" in shown
