"""The console in a real headless Chromium (Debian's `chromium`, driven by Playwright) against
the real TLS server and the real OpenID provider (tests/appliance/auth/idp.py): signing in as
an admin and as an auditor through the IdP's login page, every page, role gating, a forged CSRF
token refused, the CSP header, a session that survives a server restart, revocation, the
Overview's charts polling their series and redrawing (and the page without script), no
request anywhere but 127.0.0.1, and no serious or critical accessibility violation (axe-core).

Each page's screenshot is saved under test-artifacts/console/ (ARTIFACTS) for people to look at.
Without /usr/bin/chromium (or playwright, or axe-core) these tests skip, except in CI
(CI=true), where they fail: CI must prove them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from appliance.auth.console_ticket import mint_console_ticket
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE
from appliance.config import Settings
from appliance.engine.engine import Engine
from audit.__main__ import main as audit_main
from audit.event import Actor, Outcome, inference_complete
from tests.appliance.api.conftest import RunningServer, make_settings, running_server
from tests.appliance.auth.idp import AUDIENCE, IdpCa, OidcProvider
from tests.appliance.auth.realm import CONSOLE_SECRET, SERVICE_SECRET, issuer_settings, start_idp

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts" / "console"
# axe-core (npm, pinned in axe/package.json; ./bootstrap test runs `npm ci` there).
AXE = Path(__file__).resolve().parent / "axe" / "node_modules" / "axe-core" / "axe.min.js"
VIEWPORT = {"width": 1280, "height": 800}
# The Overview's charts poll once per sampling interval: short here, so that they move quickly.
SERIES_INTERVAL_S = 0.5


def _missing(what: str) -> None:
    message = f"{what}; ./bootstrap test installs it"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


if not CHROMIUM.exists():
    _missing(f"the console's browser tests need Debian's chromium at {CHROMIUM}")
if not AXE.exists():
    _missing(f"the console's accessibility checks need axe-core at {AXE}")
try:
    from playwright.sync_api import (
        Browser,
        BrowserContext,
        Page,
        Request,
        Route,
        sync_playwright,
    )
except ImportError:
    _missing("the console's browser tests need playwright (the test extra)")


@pytest.fixture(scope="module")
def port() -> int:
    """The server's port, known before the IdP registers the console's redirect URI."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def idp_ca(tmp_path_factory: pytest.TempPathFactory) -> IdpCa:
    return IdpCa.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def idp(
    idp_ca: IdpCa, port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OidcProvider]:
    provider = start_idp(tmp_path_factory.mktemp("idp"), idp_ca, f"https://127.0.0.1:{port}")
    try:
        yield provider
    finally:
        provider.stop()


class RestartableServer:
    """The appliance on a fixed port, which a test can stop and start again on the same
    settings (and so the same audit database)."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self._stack = ExitStack()
        self.running: RunningServer | None = None

    def start(self) -> RunningServer:
        self.running = self._stack.enter_context(
            running_server(self.settings, self.engine, series_interval_s=SERIES_INTERVAL_S)
        )
        return self.running

    def restart(self) -> RunningServer:
        self.stop()
        return self.start()

    def stop(self) -> None:
        self._stack.close()
        self._stack = ExitStack()
        self.running = None


@pytest.fixture(scope="module")
def appliance(
    idp: OidcProvider, idp_ca: IdpCa, port: int, api_engine: Engine, smollm2_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RestartableServer]:  # fmt: skip
    directory = tmp_path_factory.mktemp("appliance")
    secret_file = directory / "console-secret"
    secret_file.write_text(CONSOLE_SECRET)
    origin = f"https://127.0.0.1:{port}"
    issuer = issuer_settings(
        idp,
        console_client_id=AUDIENCE,
        console_client_secret_file=str(secret_file),
        console_redirect_uri=f"{origin}/console/callback",
        console_post_logout_redirect_uri=f"{origin}/console/",
    )
    auth = {"issuers": [issuer], "ca_file": str(idp_ca.cert_file),
            "jwks_cache_dir": str(directory / "jwks")}  # fmt: skip
    server = RestartableServer(make_settings(directory, smollm2_dir, auth=auth, port=port),
                               api_engine)  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class Tab:
    """One browser context (its own cookies) and page, recording every request it makes."""

    def __init__(self, browser: Browser, base_url: str, timezone_id: str = "UTC") -> None:
        # The server's certificate is self-signed and the IdP's from a test CA that Chromium's
        # store does not hold; the tests check what is served, not the certificate chain.
        self.context: BrowserContext = browser.new_context(
            ignore_https_errors=True, viewport=VIEWPORT, base_url=base_url,
            timezone_id=timezone_id, locale="en-GB",
        )  # fmt: skip
        self.hosts: set[str] = set()
        self.context.route("**/*", self._intercept)
        self.page: Page = self.context.new_page()

    def _intercept(self, route: Route, request: Request) -> None:
        """Record every request's host; let none leave 127.0.0.1."""
        host = urlsplit(request.url).hostname or request.url
        self.hosts.add(host)
        if host == "127.0.0.1":
            route.continue_()
        else:
            route.abort()

    def sign_in(self, login: str) -> None:
        """Sign in through the IdP's own login page, as a person would."""
        self.page.goto("/console/login")
        self.page.fill("input[name=login]", login)
        self.page.fill("input[name=password]", f"{login}-password")
        self.page.click("button")
        self.page.wait_for_url("**/console/**")
        self.page.wait_for_load_state("networkidle")

    def visit(self, path: str, screenshot: str | None = None) -> Any:
        response = self.page.goto(path)
        assert response is not None
        if screenshot is not None:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(ARTIFACTS / f"{screenshot}.png"), full_page=True)
        return response

    def visit_screenshot(self, name: str) -> None:
        """A screenshot of the page as it is now (no reload)."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def serious_accessibility_violations(self) -> list[str]:
        """axe-core's serious and critical violations on the page shown (WCAG 2.x A and AA
        rules). It is injected through the DevTools protocol, which the page's CSP does not
        govern: the console's own CSP stays as strict as it is."""
        self.page.evaluate(AXE.read_text(encoding="utf-8"))
        result = self.page.evaluate("axe.run(document, {resultTypes: ['violations']})")
        return [
            f"{v['id']} ({v['impact']}): {v['help']}; {[n['target'] for n in v['nodes']]}"
            for v in result["violations"]
            if v["impact"] in ("serious", "critical")
        ]

    def close(self) -> None:
        self.context.close()
        # Nothing but the appliance and the IdP, both on 127.0.0.1: no CDN, font or telemetry.
        assert self.hosts <= {"127.0.0.1"}, self.hosts


@pytest.fixture
def tabs(browser: Browser, appliance: RestartableServer) -> Iterator[list[Tab]]:
    """Open tabs with `tabs.append(Tab(...))`; each is closed and checked afterwards."""
    opened: list[Tab] = []
    yield opened
    for tab in opened:
        tab.close()


def open_tab(
    tabs: list[Tab], browser: Browser, appliance: RestartableServer, timezone_id: str = "UTC"
) -> Tab:
    assert appliance.running is not None
    tab = Tab(browser, appliance.running.url, timezone_id)
    tabs.append(tab)
    return tab


def test_admin_signs_in_and_sees_every_page(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("bob")
    assert tab.page.url.endswith("/console/")
    assert tab.page.locator("h1").inner_text() == "Overview"
    assert tab.page.get_by_role("alert").inner_text().startswith("UNVERIFIED")
    pages = [("/console/", "Overview", "overview"),
             ("/console/attestation", "Attestation", "attestation"),
             ("/console/audit", "Audit log", "audit"),
             ("/console/access", "Access", "access"),
             ("/console/system", "System", "system")]  # fmt: skip
    for path, heading, name in pages:
        response = tab.visit(path, f"admin-{name}")
        assert response.status == 200
        assert tab.serious_accessibility_violations() == [], path
        csp = response.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert tab.page.locator("h1").inner_text() == heading
        nav = tab.page.get_by_role("navigation", name="Console pages")
        assert nav.get_by_role("link").all_inner_texts() == [
            "Overview", "Attestation", "Audit", "Usage", "Access", "System",
        ]  # fmt: skip
    tab.visit("/console/audit")
    tab.page.get_by_label("Action").fill("boot.start")
    tab.page.get_by_role("button", name="Search").click()
    tab.page.get_by_role("link", name="Entry 0").click()
    assert tab.page.locator("h1").inner_text() == "Audit entry 0"
    assert "python -m audit verify-proof" in tab.page.locator("pre.command").inner_text()
    tab.visit(tab.page.url, "admin-audit-entry")
    assert tab.serious_accessibility_violations() == []
    access = tab.visit("/console/access")
    assert access.status == 200
    assert "bob" in tab.page.locator("table").first.inner_text()
    revoke = tab.page.get_by_role("button", name="Revoke the session of bob signed in 20")
    assert revoke.first.inner_text() == "Revoke"
    issuers = tab.page.locator("table").nth(1).inner_text()
    assert "key ids: key-1" in issuers and "fetched" in issuers  # the IdP's key, as used
    assert "refreshed at the first token after" in issuers and "refused after" in issuers
    assert "admin ← admin, inferno-admins" in issuers  # the configured role mapping


def test_auditor_sees_attestation_and_audit_only(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance, timezone_id="Asia/Kolkata")
    tab.sign_in("carol")
    assert tab.page.url.endswith("/console/attestation")
    nav = tab.page.get_by_role("navigation", name="Console pages")
    assert nav.get_by_role("link").all_inner_texts() == ["Attestation", "Audit"]
    assert tab.page.get_by_role("button", name="Re-attest now").count() == 0
    assert tab.visit("/console/audit", "auditor-audit").status == 200
    # Times read in the viewer's zone (UTC+5:30 here), with the UTC time on hover.
    first = tab.page.locator("table time").first
    assert "GMT+5:30" in first.inner_text()
    assert first.get_attribute("title").endswith("Z")
    assert tab.serious_accessibility_violations() == []
    assert appliance.running is not None
    appliance.running.app.state.audit_trail.log.checkpoint()  # one at least, to list
    tab.page.get_by_role("link", name="all checkpoints").click()
    tab.page.wait_for_url("**/console/checkpoints")
    tab.page.screenshot(path=str(ARTIFACTS / "auditor-checkpoints.png"), full_page=True)
    assert tab.page.locator("h1").inner_text() == "Checkpoints"
    assert tab.page.get_by_text("Show the note of").count() >= 1
    assert tab.serious_accessibility_violations() == []
    refused = tab.visit("/console/system", "auditor-system-403")
    assert refused.status == 403
    assert tab.page.locator("h1").inner_text() == "Not allowed"
    assert tab.serious_accessibility_violations() == []


def test_a_user_without_a_console_role_gets_a_403_page(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("alice")
    assert tab.visit("/console/", "user-403").status == 403
    assert "needs the role admin or auditor" in tab.page.content()


def test_forged_csrf_token_is_refused_and_changes_nothing(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("bob")
    tab.visit("/console/system")
    tab.page.locator("form.action input[name=csrf_token]").evaluate("e => e.value = 'forged'")
    tab.page.get_by_label("Yes, stop taking inference requests until restart").check()
    with tab.page.expect_navigation() as navigation:
        tab.page.get_by_role("button", name="Drain").click()
    assert navigation.value.status == 403
    assert "CSRF" in tab.page.content()
    assert appliance.running is not None
    assert appliance.running.app.state.readiness.state()[0] == "ready"


def test_admin_revokes_a_session_and_its_browser_is_signed_out(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    auditor, admin = open_tab(tabs, browser, appliance), open_tab(tabs, browser, appliance)
    auditor.sign_in("carol")
    admin.sign_in("bob")
    admin.visit("/console/access")
    rows = admin.page.locator("tr", has_text="carol")
    assert rows.count() >= 1
    for _ in range(rows.count()):  # every session carol holds, this test's and earlier ones
        rows.first.get_by_role("button", name="Revoke").click()
        admin.page.wait_for_url("**/console/access?revoked=1")
    assert admin.page.get_by_role("status").inner_text().startswith("Session revoked")
    assert admin.page.locator("tr", has_text="carol").count() == 0
    signed_out = auditor.visit("/console/audit", "signed-out-401")
    assert signed_out.status == 401
    assert auditor.serious_accessibility_violations() == []
    assert auditor.page.get_by_role("link", name="Sign in with your identity provider").count()


def test_session_survives_a_server_restart(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("bob")
    appliance.restart()
    response = tab.visit("/console/system")
    assert response.status == 200
    assert tab.page.locator("h1").inner_text() == "System"


def test_sign_out_ends_the_session(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("bob")
    tab.page.get_by_role("button", name="Sign out").click()
    # RP-initiated logout goes on at the IdP, which sends the browser back to the console.
    tab.page.get_by_role("button", name="Sign out").click()
    tab.page.wait_for_url("**/console/")
    assert tab.page.locator("h1").inner_text() == "Sign in to use the console"
    assert tab.visit("/console/system").status == 401


def test_admin_exports_audit_and_usage_and_pages_the_verdict_history(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab], tmp_path: Path
) -> None:
    assert appliance.running is not None
    log = appliance.running.app.state.audit_trail.log
    log.append(inference_complete(
        time=datetime.now(UTC), actor=Actor("urn:idp", "batch-job", None, ("service",)),
        source_address=None, request_id="r-1", outcome=Outcome.SUCCESS, model="smollm2",
        weights_digest="sha256:00", prompt_tokens=120, completion_tokens=48,
        finish_reason="stop", latency_ms=812.0, prompt_commitment="c", response_commitment="c",
    ))  # fmt: skip
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("bob")
    for path, heading, name in [("/console/usage", "Usage", "usage"),
                                ("/console/export", "Audit export", "audit-export"),
                                ("/console/attestation/history", "Attestation history",
                                 "attestation-history")]:  # fmt: skip
        assert tab.visit(path, f"admin-{name}").status == 200
        assert tab.page.locator("h1").inner_text() == heading
        assert tab.serious_accessibility_violations() == [], path
    tab.visit("/console/usage")
    assert "batch-job" in tab.page.locator("table").inner_text()
    tab.page.get_by_label("Count per").select_option("role")
    tab.page.get_by_role("button", name="Show").click()
    assert "service" in tab.page.locator("table").inner_text()
    with tab.page.expect_download() as csv_download:
        tab.page.get_by_role("button", name="Download CSV").click()
    assert "batch-job" in Path(csv_download.value.path()).read_text(encoding="utf-8")
    tab.visit("/console/export")
    tab.page.get_by_label("First entry").fill("0")
    with tab.page.expect_download() as bundle_download:
        tab.page.get_by_role("button", name="Export bundle").click()
    bundle = tmp_path / bundle_download.value.suggested_filename
    bundle_download.value.save_as(bundle)
    assert audit_main(["verify", str(bundle), "--vkey", log.vkey]) == 0


def test_auditor_exports_but_has_no_usage_page(
    browser: Browser, appliance: RestartableServer, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("carol")
    assert tab.visit("/console/export", "auditor-audit-export").status == 200
    assert tab.serious_accessibility_violations() == []
    tab.page.get_by_label("First entry").fill("5")
    tab.page.get_by_label("Last entry").fill("2")
    with tab.page.expect_navigation() as navigation:
        tab.page.get_by_role("button", name="Export bundle").click()
    assert navigation.value.status == 400
    assert "the last index comes before the first" in tab.page.content()
    tab.page.screenshot(path=str(ARTIFACTS / "auditor-export-400.png"), full_page=True)
    assert tab.serious_accessibility_violations() == []
    assert tab.visit("/console/attestation/history").status == 200
    assert tab.visit("/console/usage").status == 403


@pytest.fixture(scope="module")
def demo(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The appliance with the demo's settings: its local issuer, no identity provider."""
    settings = make_settings(tmp_path_factory.mktemp("demo"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running


def test_the_demos_sign_in_link_signs_an_admin_in_once(
    browser: Browser, demo: RunningServer, tabs: list[Tab]
) -> None:
    issuer = demo.app.state.console.local_issuer
    text, _ = mint_console_ticket(issuer, Role.ADMIN, "demo-admin", time.time())
    link = f"/console/login/local?ticket={text}"
    tab = Tab(browser, demo.url)
    tabs.append(tab)
    tab.page.goto(link)
    tab.page.wait_for_url("**/console/")
    assert tab.page.locator("h1").inner_text() == "Overview"
    assert tab.page.locator(".who").inner_text().startswith("demo-admin (admin)")
    tab.visit("/console/", "demo-overview")
    assert tab.visit("/console/access", "demo-access").status == 200
    assert tab.serious_accessibility_violations() == []
    local = tab.page.get_by_role("table", name="The appliance's own issuer").inner_text()
    assert issuer.kid in local and "admin ← admin" in local
    tab.page.get_by_role("link", name="Tokens: mint and list").click()
    assert tab.page.locator("h1").inner_text() == "Local-issuer tokens"
    tab.page.get_by_label("Subject (who will use it)").fill("team-search")
    tab.page.get_by_label("service").check()
    tab.page.get_by_label("Lifetime, minutes").fill("15")
    tab.page.get_by_role("button", name="Mint token").click()
    assert tab.page.locator("h1").inner_text() == "Token minted"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    tab.page.screenshot(path=str(ARTIFACTS / "demo-token-minted.png"), full_page=True)
    assert tab.serious_accessibility_violations() == []
    token = tab.page.get_by_label("Bearer token").input_value()
    assert token.count(".") == 2
    assert tab.visit("/console/access/tokens", "demo-tokens").status == 200
    assert tab.serious_accessibility_violations() == []
    listed = tab.page.locator("table").inner_text()
    assert "team-search" in listed and "demo-admin" in listed and token not in tab.page.content()
    # The same link again, in another browser: refused, with the way to a new one.
    again = Tab(browser, demo.url)
    tabs.append(again)
    refused = again.visit(link, "demo-link-used-again")
    assert refused.status == 400
    assert "used already" in again.page.content() and "inferno console-link" in again.page.content()
    assert again.serious_accessibility_violations() == []
    tab.page.get_by_role("button", name="Sign out").click()
    tab.page.wait_for_url("**/console/")
    assert tab.page.locator("h1").inner_text() == "Sign in to use the console"
    tab.visit(tab.page.url, "demo-signed-out")
    assert tab.serious_accessibility_violations() == []


REQUESTS_CHART = 'figure[data-chart="requests"]'


def test_overview_charts_poll_the_series_and_redraw_as_traffic_comes(
    browser: Browser, appliance: RestartableServer, idp: OidcProvider, tabs: list[Tab]
) -> None:
    tab = open_tab(tabs, browser, appliance)
    tab.sign_in("bob")
    polled: list[str] = []
    tab.page.on("request", lambda r: polled.append(r.url) if "/overview/series" in r.url else None)
    tab.visit("/console/")
    plot = tab.page.locator(f"{REQUESTS_CHART} svg")
    tab.page.wait_for_function(
        "s => document.querySelector(s).dataset.seq !== undefined", arg=f"{REQUESTS_CHART} svg"
    )
    first_seq = int(plot.get_attribute("data-seq") or "-1")
    assert plot.locator("path.series").count() == 1
    assert appliance.running is not None
    token = idp.client_credentials_token("svc-batch", SERVICE_SECRET)  # a service: inference
    with appliance.running.http(role=None) as api:
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8}
        done = api.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"})
        assert done.status_code == 200, done.text
    # The request shows: the chart's highest value over the hour is no longer 0.
    tab.page.wait_for_function(
        "s => !/highest in the last .+ 0 req\\/s\\.$/.test(document.querySelector(s).textContent)",
        arg=f'{REQUESTS_CHART} [data-summary="requests"]',
        timeout=30_000,
    )
    assert int(plot.get_attribute("data-seq") or "-1") > first_seq
    path = plot.locator("path.series").get_attribute("d") or ""
    assert path.count("L") >= 1  # a line through several points, not a dot
    ttft = tab.page.locator('figure[data-chart="ttft"] path.series')
    assert ttft.count() == 2 and "M" in (ttft.nth(1).get_attribute("d") or "")  # p50 and p99
    # This page's first poll took the whole series, every later one (at least the one that
    # brought the request) only the points it lacked (signing in landed on the Overview
    # already: that page polled too).
    loaded = max(i for i, url in enumerate(polled) if url.endswith("/console/overview/series"))
    assert len(polled[loaded:]) >= 2 and all("&after=" in url for url in polled[loaded + 1 :])
    assert tab.page.locator("[data-charts-status]").inner_text().startswith("Live:")
    tab.visit_screenshot("admin-overview-live")
    assert tab.serious_accessibility_violations() == []


def test_overview_without_script_shows_the_values_as_text(
    browser: Browser, appliance: RestartableServer
) -> None:
    assert appliance.running is not None
    principal = Principal("urn:test", "no-script", None, frozenset({Role.ADMIN}), 0.0)
    session = appliance.running.app.state.sessions.create(principal, "id.token")
    context = browser.new_context(
        ignore_https_errors=True, viewport=VIEWPORT, java_script_enabled=False
    )
    try:
        context.add_cookies(
            [{"name": SESSION_COOKIE, "value": session.id, "url": appliance.running.url}]
        )
        page = context.new_page()
        assert page.goto(f"{appliance.running.url}/console/").status == 200  # type: ignore[union-attr]
        traffic = page.get_by_role("region", name="Traffic").inner_text()
        assert "Requests" in traffic and "Time to first token" in traffic
        assert page.locator(f"{REQUESTS_CHART} svg").is_hidden()
        assert (
            page.locator(f"{REQUESTS_CHART} .chart-summary")
            .inner_text()
            .startswith(("Now", "No sample yet"))
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "admin-overview-no-script.png"), full_page=True)
    finally:
        context.close()
