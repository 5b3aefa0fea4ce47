"""The console's pages and actions over HTTP against the real TLS server: role gating, the
security headers, CSRF through forms, admin actions audited before they take effect (and
refused when the log cannot record them), audit entries with proofs that verify offline,
settings with secrets redacted. (Browser tests: test_browser.py.)"""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE, Session
from appliance.console import routes as console_routes
from appliance.console.routes import REDACTED, redacted_settings
from appliance.console.series import FIELDS, SeriesSampler
from appliance.engine.engine import Engine
from audit.__main__ import main as audit_main
from audit.errors import AuditWriteError
from audit.event import Actor, Outcome, admin_action
from tests.appliance.api.conftest import RunningServer, make_settings, running_server

SERIES = "/console/overview/series"
_ACTOR = Actor("urn:test", "an-admin", None, ("admin",))
SERIES_INTERVAL_S = 0.25
PAGES = ["/console/", "/console/attestation", "/console/audit", "/console/access",
         "/console/system"]  # fmt: skip


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("console"), smollm2_dir)
    with running_server(settings, api_engine, series_interval_s=SERIES_INTERVAL_S) as running:
        yield running


def sign_in(server: RunningServer, role: Role, subject: str | None = None) -> Session:
    principal = Principal("urn:test", subject or f"an-{role}", None, frozenset({role}), 0.0)
    return server.app.state.sessions.create(principal, "id.token.hint")


def browser(server: RunningServer, session: Session | None) -> httpx.Client:
    cookies = {} if session is None else {SESSION_COOKIE: session.id}
    return httpx.Client(base_url=server.url, verify=server.tls_context(), cookies=cookies,
                        timeout=60, follow_redirects=True)  # fmt: skip


def entries(server: RunningServer) -> list[dict[str, object]]:
    store = server.app.state.audit_trail.log.store
    return [json.loads(data) for _, data in store.entries(0, store.size() - 1)]


def test_admin_sees_every_page_with_the_security_headers(server: RunningServer) -> None:
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        for path in PAGES:
            page = http.get(path)
            assert page.status_code == 200, (path, page.text)
            assert page.headers["content-type"].startswith("text/html")
            csp = page.headers["content-security-policy"]
            assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert "unsafe-inline" not in csp
            assert page.headers["cache-control"] == "no-store"
            scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.S)
            files = ["console.js", "overview.js"] if path == "/console/" else ["console.js"]
            assert scripts == [(f' src="/console/static/{name}" defer', "") for name in files]
            assert "style=" not in page.text
            assert "UNVERIFIED" in page.text  # the demo's insecure-dev, on every page


def sampler_of(server: RunningServer) -> SeriesSampler:
    return server.app.state.console.sampler


def wait_for(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


def test_overview_shows_the_tee_the_model_the_gpus_the_engine_and_the_charts(
    server: RunningServer,
) -> None:
    sampler = sampler_of(server)
    wait_for(lambda: sampler.series.last_seq >= 0)  # the GPUs were read, a point was taken
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        page = http.get("/console/").text
    assert "Next re-attestation" in page and "none: nothing is attested in insecure-dev" in page
    assert "not sealed: the weights are read in the clear" in page and "(insecure-dev)" in page
    assert str(server.app.state.audit_trail.weights_digest) in page
    if sampler.gpus.no_gpu:  # this machine, as CI's: NVML finds no GPU
        assert "No GPU: the engine runs on the CPU." in page
        assert '<table class="gpus">' not in page
        expected = ["requests", "tokens", "ttft", "tpot", "load", "kv", "prefix", "preemptions"]
    else:
        assert '<table class="gpus">' in page
        expected = ["requests", "tokens", "ttft", "tpot", "load", "kv", "prefix", "preemptions",
                    "gpu-utilization", "gpu-memory", "gpu-temperature"]  # fmt: skip
    assert re.findall(r'<figure class="chart" data-chart="([a-z-]+)"', page) == expected
    for key in expected:  # each chart is an image named by its title and its summary
        assert f'aria-labelledby="chart-{key}-title chart-{key}-summary"' in page
        assert re.search(rf'data-summary="{key}">Now [^<]+; highest in the last', page), key


def test_the_series_endpoint_gives_every_point_then_only_the_new_ones(
    server: RunningServer,
) -> None:
    with server.http() as api:
        body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 4}
        done = api.post("/v1/completions", json=body)
        assert done.status_code == 200
    sampler = sampler_of(server)
    wait_for(lambda: any(p.requests_per_s > 0 for p in sampler.series.points()))
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        answer = http.get(SERIES)
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["cache-control"] == "no-store"
        assert "default-src 'self'" in answer.headers["content-security-policy"]
        first = answer.json()
        assert first["reset"] is True and first["interval_s"] == SERIES_INTERVAL_S
        series = first["series"]
        assert set(series) == set(FIELDS)
        assert len({len(values) for values in series.values()}) == 1  # one column per field
        assert series["seq"][-1] == first["last_seq"]
        ended = [i for i, rate in enumerate(series["requests_per_s"]) if rate > 0]
        assert ended and series["ttft_p50_s"][ended[-1]] > 0  # the request's latency, charted
        assert first["summaries"]["requests"].startswith("Now ")
        assert first["current"]["running"] == "0"
        wait_for(lambda: sampler.series.last_seq > first["last_seq"])
        known = {"series": first["series_id"], "after": first["last_seq"]}
        later = http.get(SERIES, params=known).json()
        assert later["reset"] is False
        assert later["series"]["seq"] and min(later["series"]["seq"]) == first["last_seq"] + 1
        # A page of another series (from before a restart) or a bad query gets everything.
        assert http.get(SERIES, params={**known, "series": "0" * 16}).json()["reset"] is True
        for after in ("junk", "-1", str(10**9), "9" * 40):
            assert http.get(SERIES, params={**known, "after": after}).json()["reset"] is True


@pytest.mark.parametrize(("role", "status"), [(Role.AUDITOR, 403), (Role.USER, 403), (None, 401)])
def test_the_series_endpoint_is_for_admins_only(
    server: RunningServer, role: Role | None, status: int
) -> None:
    with browser(server, None if role is None else sign_in(server, role)) as http:
        refused = http.get(SERIES)
    assert refused.status_code == status
    assert "requests_per_s" not in refused.text


def test_auditor_sees_attestation_and_audit_only(server: RunningServer) -> None:
    with browser(server, sign_in(server, Role.AUDITOR)) as http:
        landing = http.get("/console/", follow_redirects=False)
        assert (landing.status_code, landing.headers["location"]) == (303, "/console/attestation")
        audit = http.get("/console/audit")
        assert audit.status_code == 200
        assert 'href="/console/access"' not in audit.text  # not in the menu either
        for path in ("/console/access", "/console/system"):
            refused = http.get(path)
            assert refused.status_code == 403
            assert "Not allowed" in refused.text and "needs the role admin" in refused.text


@pytest.mark.parametrize("role", [Role.USER, Role.SERVICE])
def test_other_roles_get_a_403_page(server: RunningServer, role: Role) -> None:
    with browser(server, sign_in(server, role)) as http:
        for path in PAGES:
            refused = http.get(path)
            assert refused.status_code == 403
            assert refused.headers["content-type"].startswith("text/html")


def test_without_a_session_pages_say_how_to_sign_in(server: RunningServer) -> None:
    with browser(server, None) as http:
        page = http.get("/console/system")
        unknown = http.get("/console/nowhere")
    # The demo's settings: no identity provider, so the one-time link is the way in.
    assert page.status_code == 401 and "inferno console-link" in page.text
    assert page.headers["www-authenticate"].startswith("Bearer")
    assert unknown.status_code == 404 and unknown.headers["content-type"].startswith("text/html")


def test_revoking_a_session_is_audited_first_and_ends_it(server: RunningServer) -> None:
    admin, victim = sign_in(server, Role.ADMIN), sign_in(server, Role.AUDITOR, "victim")
    with browser(server, admin) as http:
        url = f"/console/access/sessions/{victim.handle}/revoke"
        assert http.post(url, data={}).status_code == 403  # no CSRF token
        assert http.post(url, data={"csrf_token": "wrong"}).status_code == 403
        done = http.post(url, data={"csrf_token": admin.csrf_token}, follow_redirects=False)
        assert (done.status_code, done.headers["location"]) == (303, "/console/access?revoked=1")
    assert server.app.state.sessions.get(victim.id) is None
    revoke = [e for e in entries(server) if e["action"] == "admin.session.revoke"][-1]
    assert revoke["actor"]["subject"] == "an-admin" and revoke["outcome"] == "accepted"
    assert revoke["details"]["target"]["subject"] == "victim"
    with browser(server, victim) as http:
        assert http.get("/console/audit").status_code == 401


@pytest.mark.parametrize(
    "body",
    [
        "&".join(f"f{i}=x" for i in range(100)) + "&csrf_token={token}",  # too many fields
        "pad=" + "x" * (70 << 10) + "&csrf_token={token}",  # over MAX_FORM_BYTES
        "csrf_token={token}&csrf_token={token}",  # two tokens
    ],
)
def test_hostile_forms_are_refused_as_without_a_csrf_token(
    server: RunningServer, body: str
) -> None:
    admin = sign_in(server, Role.ADMIN)
    with browser(server, admin) as http:
        refused = http.post(
            "/console/system/drain",
            content=body.format(token=admin.csrf_token),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
    assert refused.status_code == 403 and "CSRF" in refused.text
    assert server.app.state.readiness.state()[0] == "ready"


def test_an_action_the_log_cannot_record_is_refused(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin, victim = sign_in(server, Role.ADMIN), sign_in(server, Role.AUDITOR, "kept")

    async def refuse(event: object) -> None:
        raise AuditWriteError("disk full")

    monkeypatch.setattr(server.app.state.console.trail, "append", refuse)
    with browser(server, admin) as http:
        url = f"/console/access/sessions/{victim.handle}/revoke"
        refused = http.post(url, data={"csrf_token": admin.csrf_token})
    assert refused.status_code == 503 and "was not done" in refused.text
    assert server.app.state.sessions.get(victim.id) is not None


def test_audit_search_and_an_entry_whose_proof_verifies_offline(
    server: RunningServer, tmp_path: Path
) -> None:
    with browser(server, sign_in(server, Role.AUDITOR, "searcher")) as http:
        found = http.get("/console/audit", params={"action": "boot.start"})
        assert found.status_code == 200
        index = int(re.search(r'href="/console/audit/(\d+)"', found.text).group(1))
        detail = http.get(f"/console/audit/{index}")
        assert "python -m audit verify-proof" in detail.text
        for kind, name in (("entry", "entry.json"), ("proof", "proof.txt")):
            download = http.get(f"/console/audit/{index}", params={"download": kind})
            (tmp_path / name).write_bytes(download.content)
        assert "Latest checkpoint" in found.text
        bad = http.get("/console/audit", params={"since": "soon"})
        assert bad.status_code == 200 and "since must be a time" in bad.text
        assert http.get("/console/audit/999999").status_code == 404
    vkey = server.app.state.audit_trail.log.vkey
    assert audit_main(["verify-proof", str(tmp_path / "proof.txt"), "--vkey", vkey,
                       "--entry", str(tmp_path / "entry.json")]) == 0  # fmt: skip


def test_checkpoints_are_listed_largest_first_in_pages_with_their_signed_notes(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = server.app.state.audit_trail.log
    for _ in range(3):  # each with one entry more than the last
        event = admin_action(time=datetime.now(UTC), actor=_ACTOR, source_address=None,
                             request_id=None, operation="test.checkpoint", target={},
                             outcome=Outcome.SUCCESS)  # fmt: skip
        log.append(event)
        log.checkpoint()
    sizes = [c.size for c in log.store.recent_checkpoints(None, 1000)]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) >= 3
    monkeypatch.setattr(console_routes, "CHECKPOINTS_PAGE_SIZE", 2)
    with browser(server, sign_in(server, Role.AUDITOR, "checker")) as http:
        first = http.get("/console/checkpoints")
        assert first.status_code == 200
        shown = [int(n) for n in re.findall(r"<tr>\s*<td>(\d+)</td>", first.text)]
        assert shown == sizes[:2]
        newest = log.store.recent_checkpoints(None, 1)[0]
        assert html.escape(newest.note) in first.text  # the signed note itself
        older = re.search(r'href="/console/checkpoints\?below=(\d+)"', first.text).group(1)
        assert int(older) == sizes[1]
        second = http.get("/console/checkpoints", params={"below": older})
        assert [int(n) for n in re.findall(r"<tr>\s*<td>(\d+)</td>", second.text)] == sizes[2:4]
        for bad in ("0", "-1", "x", "1e3"):
            refused = http.get("/console/checkpoints", params={"below": bad})
            assert (
                refused.status_code == 400 and "below must be a positive tree size" in refused.text
            )
        assert http.get("/console/checkpoints", params={"below": "1"}).text.count("<tr>") == 0
    with browser(server, sign_in(server, Role.USER)) as http:
        assert http.get("/console/checkpoints").status_code == 403


def test_reattest_in_insecure_dev_is_refused_with_a_reason(server: RunningServer) -> None:
    admin = sign_in(server, Role.ADMIN)
    with browser(server, admin) as http:
        page = http.get("/console/attestation")
        assert "disabled" in page.text and "Not available in insecure-dev" in page.text
        refused = http.post("/console/attestation/reattest", data={"csrf_token": admin.csrf_token})
    assert refused.status_code == 409 and "insecure-dev" in refused.text


def test_settings_are_shown_with_secrets_redacted(tmp_path: Path, smollm2_dir: Path) -> None:
    settings = make_settings(
        tmp_path, smollm2_dir, audit={"database_url": "postgresql+psycopg://inferno:hunter2@db/a"}
    )
    shown = dict(redacted_settings(settings))
    audit, auth = dict(shown["audit"]), dict(shown["auth"])
    assert audit["database_url"] == "postgresql+psycopg://inferno:***@db/a"
    assert auth["local_issuer_key_file"] == REDACTED
    assert dict(shown["tls"])["key_file"] == REDACTED
    assert "hunter2" not in json.dumps(shown)


def test_drain_needs_confirmation_then_is_audited_and_stops_inference(
    api_engine: Engine, smollm2_dir: Path, tmp_path: Path
) -> None:
    settings = make_settings(tmp_path, smollm2_dir)
    with running_server(settings, api_engine) as server:
        admin = sign_in(server, Role.ADMIN, "operator")
        with browser(server, admin) as http:
            unconfirmed = http.post("/console/system/drain", data={"csrf_token": admin.csrf_token})
            assert unconfirmed.status_code == 400
            assert http.get("/health").status_code == 200
            confirmed = {"csrf_token": admin.csrf_token, "confirm": "drain"}
            drained = http.post("/console/system/drain", data=confirmed)
            assert drained.status_code == 200 and "Drained" in drained.text
            health = http.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "draining",
            "reason": "drained by operator; restart the server to serve again",
        }
        with server.http() as api:
            refused = api.post("/v1/completions", json={"model": "smollm2", "prompt": "hi"})
        assert refused.status_code == 503
        actions = [e["action"] for e in entries(server)]
        assert "admin.server.drain" in actions
