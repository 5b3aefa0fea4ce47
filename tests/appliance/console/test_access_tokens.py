"""The Access page's local-issuer tokens and the demo's sign-in link, over HTTP against the
real TLS server (with the demo's settings: a local issuer, no identity provider): minting is
audited before the token exists and the token is shown once, never stored; listing is audited;
bad input gets a 400 page; a sign-in link signs in once as the admin it names, and an expired,
forged or replayed one is refused. (Browser tests: test_browser.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jwt
import pytest

from appliance.auth.console_ticket import TICKET_TTL_S, mint_console_ticket
from appliance.auth.key_cache import KeyStatus
from appliance.auth.local_issuer import LOCAL_ROLE_MAPPING, LocalIssuer
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE
from appliance.auth.settings import AuthSettings
from appliance.console.pages import SIGNED_OUT, ConsolePages
from appliance.console.table import sort_and_page
from appliance.console.tokens import TokenRecord
from appliance.engine.engine import Engine
from audit.errors import AuditWriteError
from tests.appliance.api.conftest import RunningServer, make_settings, running_server
from tests.appliance.console.test_routes import browser, entries, sign_in


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("access"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running


def _issuer(server: RunningServer) -> LocalIssuer:
    issuer = server.app.state.console.local_issuer
    assert issuer is not None
    return issuer


def test_access_page_shows_the_local_issuer_its_key_and_role_mapping(
    server: RunningServer,
) -> None:
    with browser(server, sign_in(server, Role.ADMIN)) as http:
        page = http.get("/console/access")
    assert page.status_code == 200
    assert _issuer(server).kid in page.text and "pinned JWK Set" in page.text
    assert "admin ← <code>admin</code>" in page.text and "<code>roles</code>" in page.text
    assert 'href="/console/access/tokens"' in page.text


def test_minting_is_audited_first_and_shows_the_token_once(server: RunningServer) -> None:
    admin = sign_in(server, Role.ADMIN, "minter")
    form = {"csrf_token": admin.csrf_token, "subject": "team-search", "role": ["user", "service"],
            "lifetime_min": "30"}  # fmt: skip
    with browser(server, admin) as http:
        assert (
            http.post("/console/access/tokens", data={**form, "csrf_token": "x"}).status_code == 403
        )
        minted = http.post("/console/access/tokens", data=form)
        listed = http.get("/console/access/tokens")
    assert minted.status_code == 200 and "shown only this once" in minted.text
    token = re.search(r'<textarea id="token"[^>]*>([^<]+)</textarea>', minted.text).group(1)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert (claims["sub"], claims["roles"]) == ("team-search", ["service", "user"])
    assert claims["exp"] - claims["iat"] == 30 * 60
    # The token works on the API.
    with httpx.Client(base_url=server.url, verify=server.tls_context()) as api:
        assert (
            api.get("/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        )
    log = entries(server)
    [issue] = [e for e in log if e["action"] == "admin.token.issue"
               and e["details"]["target"]["token_id"] == claims["jti"]]  # fmt: skip
    assert issue["actor"]["subject"] == "minter" and issue["outcome"] == "accepted"
    assert issue["details"]["target"]["roles"] == ["service", "user"]
    assert not any(token in json.dumps(e) for e in log)  # the id, never the token
    # Listed (from the log), without the token; the listing itself is recorded.
    assert listed.status_code == 200 and claims["jti"] in listed.text and token not in listed.text
    assert "team-search" in listed.text and "minter" in listed.text
    [listing] = [e for e in log if e["action"] == "admin.token.list"]
    assert listing["actor"]["subject"] == "minter"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"subject": "", "role": "user", "lifetime_min": "5"}, "the subject must be"),
        ({"subject": "x", "lifetime_min": "5"}, "at least one role"),
        ({"subject": "x", "role": "root", "lifetime_min": "5"}, "&#39;root&#39; is not a role"),
        ({"subject": "x", "role": "auditor", "lifetime_min": "5"}, "do not grant the auditor"),
        ({"subject": "x", "role": "user", "lifetime_min": "61"}, "1 to 60"),
        ({"subject": "x", "role": "user", "lifetime_min": "-1"}, "1 to 60"),
        ({"subject": "x", "role": "user"}, "1 to 60"),
        ({"subject": "x", "role": "user", "lifetime_min": "²"}, "1 to 60"),
        ({"subject": "x", "role": "user", "lifetime_min": "9" * 5000}, "1 to 60"),
    ],
)
def test_bad_mint_requests_get_a_400_page_and_mint_nothing(
    server: RunningServer, fields: dict[str, object], message: str
) -> None:
    admin = sign_in(server, Role.ADMIN)
    before = len(entries(server))
    with browser(server, admin) as http:
        refused = http.post(
            "/console/access/tokens", data={"csrf_token": admin.csrf_token, **fields}
        )
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"].startswith("text/html") and message in refused.text
    assert not [e for e in entries(server)[before:] if e["action"] == "admin.token.issue"]


def test_minting_the_log_cannot_record_is_refused(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = sign_in(server, Role.ADMIN)

    async def refuse(event: object) -> None:
        raise AuditWriteError("disk full")

    monkeypatch.setattr(server.app.state.console.trail, "append", refuse)
    form = {"csrf_token": admin.csrf_token, "subject": "x", "role": "user", "lifetime_min": "5"}
    with browser(server, admin) as http:
        refused = http.post("/console/access/tokens", data=form)
        unlisted = http.get("/console/access/tokens")
    assert refused.status_code == 503 and "textarea" not in refused.text
    assert unlisted.status_code == 503  # an unrecorded listing is not shown either


def test_a_sign_in_the_log_cannot_record_is_refused_and_leaves_no_session(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, _ = mint_console_ticket(_issuer(server), Role.ADMIN, "unrecorded", time.time())

    async def refuse(event: object) -> None:
        raise AuditWriteError("disk full")

    monkeypatch.setattr(server.app.state.console.trail, "append", refuse)
    with browser(server, None) as http:
        refused = http.get(_link(server, text))
    assert refused.status_code == 503 and "set-cookie" not in refused.headers
    live = server.app.state.sessions.list_live()
    assert not [r for r in live if r.principal.subject == "unrecorded"]


def test_the_tokens_page_is_for_admins_only(server: RunningServer) -> None:
    with browser(server, sign_in(server, Role.AUDITOR)) as http:
        assert http.get("/console/access/tokens").status_code == 403


def _link(server: RunningServer, text: str) -> str:
    return f"/console/login/local?ticket={text}"


def test_a_sign_in_link_signs_in_once_as_its_admin(server: RunningServer) -> None:
    text, ticket = mint_console_ticket(_issuer(server), Role.ADMIN, "demo-admin", time.time())
    with browser(server, None) as http:
        signed_in = http.get(_link(server, text), follow_redirects=False)
        assert signed_in.status_code == 200 and "Signed in" in signed_in.text
        cookie = signed_in.headers["set-cookie"]
        assert cookie.startswith(f"{SESSION_COOKIE}=") and "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie and "Secure" in cookie
        overview = http.get("/console/")
        assert overview.status_code == 200 and "<h1>Overview</h1>" in overview.text
        assert "demo-admin" in overview.text
    with browser(server, None) as http:
        replayed = http.get(_link(server, text))
    assert replayed.status_code == 400 and "used already" in replayed.text
    assert SESSION_COOKIE not in replayed.headers.get("set-cookie", "")
    logins = [e for e in entries(server) if e["action"] == "auth.authenticate"
              and e["details"].get("ticket_id") == ticket.ticket_id]  # fmt: skip
    assert [e["outcome"] for e in logins] == ["success"]
    assert logins[0]["actor"]["subject"] == "demo-admin"
    [replay] = [
        e for e in entries(server) if e["details"].get("reason") == "sign-in link used again"
    ]
    assert replay["outcome"] == "failure"
    assert not any(text in json.dumps(e) for e in entries(server))


def test_a_sign_in_session_signs_out_without_an_identity_provider(server: RunningServer) -> None:
    text, _ = mint_console_ticket(_issuer(server), Role.ADMIN, "demo-admin", time.time())
    with browser(server, None) as http:
        http.get(_link(server, text))
        session = http.get("/console/session").json()
        out = http.post("/console/logout", data={"csrf_token": session["csrf_token"]},
                        follow_redirects=False)  # fmt: skip
        assert (out.status_code, out.headers["location"]) == (303, "/console/")
        page = http.get("/console/")
    assert page.status_code == 401 and "inferno console-link" in page.text
    assert 'href="/console/login"' not in page.text  # no identity provider to sign in with


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda issuer, other: mint_console_ticket(issuer, Role.ADMIN, "a",
                                                   time.time() - TICKET_TTL_S - 300)[0],
         "expired"),
        (lambda issuer, other: mint_console_ticket(other, Role.ADMIN, "a", time.time())[0],
         "not signed by this appliance"),
        (lambda issuer, other: issuer.mint(Role.ADMIN, "a", time.time()),
         "not a console sign-in ticket"),
        (lambda issuer, other: "", "holds no ticket"),
    ],
    ids=["expired", "forged", "api-token", "empty"],
)  # fmt: skip
def test_bad_sign_in_links_are_refused_with_a_page(
    server: RunningServer, tmp_path: Path, make: object, message: str
) -> None:
    other = LocalIssuer.load_or_create(tmp_path / "other.pem", 3600)
    text = make(_issuer(server), other)  # type: ignore[operator]
    with browser(server, None) as http:
        refused = http.get(_link(server, text))
    assert refused.status_code == 400 and message in refused.text
    assert "inferno console-link" in refused.text and "set-cookie" not in refused.headers
    # Recorded as a refused sign-in (never quoting the link's ticket).
    last = entries(server)[-1]
    assert (last["action"], last["outcome"]) == ("auth.authenticate", "failure")
    assert last["details"]["reason"].startswith("sign-in link")
    assert text == "" or text not in json.dumps(last)


def test_sign_in_links_do_not_exist_without_the_local_issuer(
    api_engine: Engine, smollm2_dir: Path, tmp_path: Path
) -> None:
    jwks = tmp_path / "jwks.json"
    issuer = LocalIssuer.load_or_create(tmp_path / "k.pem", 3600)
    jwks.write_text(json.dumps(issuer.jwks.to_json()))
    auth = {"issuers": [{"issuer": "https://idp.example.com", "audience": "inferno",
                         "jwks_file": str(jwks), "role_claims": ["roles"],
                         "roles": {"admin": ["admin"]}}]}  # fmt: skip
    settings = make_settings(tmp_path, smollm2_dir, auth=auth)
    with running_server(settings, api_engine) as server:
        text, _ = mint_console_ticket(issuer, Role.ADMIN, "a", time.time())
        with browser(server, None) as http:
            missing = http.get(_link(server, text))
        with browser(server, sign_in(server, Role.ADMIN)) as http:
            tokens = http.get("/console/access/tokens")
            access = http.get("/console/access")
    assert missing.status_code == 404 and "set-cookie" not in missing.headers
    assert tokens.status_code == 404 and "local issuer is off" in tokens.text
    assert "The local issuer is off" in access.text


def test_console_link_prints_a_link_that_signs_in_and_audits_its_issue(
    server: RunningServer, tmp_path: Path
) -> None:
    config = tmp_path / "inferno.toml"
    auth = server.settings.auth
    config.write_text(
        f'[model]\ndir = "{server.settings.model.dir}"\n[server]\nport = 8443\n'
        f'[audit]\norigin = "{server.settings.audit.origin}"\n'
        f'data_dir = "{server.settings.audit.data_dir}"\n'
        '[appliance]\nprofile = "development"\n[tee]\nmode = "insecure-dev"\n'
        f'[tls]\ncert_file = "{server.cert_file}"\nkey_file = "{tmp_path / "k.pem"}"\n'
        "self_signed = true\n"
        f'[auth]\nlocal_issuer = "demo"\nlocal_issuer_key_file = "{auth.local_issuer_key_file}"\n'
    )
    printed = subprocess.run(
        [sys.executable, "-m", "appliance", "console-link", "--config", str(config),
         "--sub", "ops-bob"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    link = printed.stdout.strip()
    assert link.startswith("https://127.0.0.1:8443/console/login/local?ticket=")
    text = link.split("ticket=", 1)[1]
    claims = jwt.decode(text, options={"verify_signature": False})
    [issued] = [e for e in entries(server) if e["action"] == "admin.console.sign_in_link"
                and e["details"]["target"]["ticket_id"] == claims["jti"]]  # fmt: skip
    assert issued["actor"]["client"] == "inferno console-link"
    assert issued["details"]["target"]["subject"] == "ops-bob"
    with browser(server, None) as http:
        assert http.get(_link(server, text)).status_code == 200
        assert http.get("/console/session").json()["subject"] == "ops-bob"


def test_an_issue_entry_without_a_token_record_is_left_out_of_the_list() -> None:
    entry = {"index": 3, "time": "2026-11-25T10:00:00.000000Z", "actor": {"subject": "x"},
             "details": {"target": {"subject": "s"}}}  # fmt: skip
    assert TokenRecord.from_entry(entry) is None
    entry["details"]["target"] = {"token_id": "t", "subject": "s", "roles": ["user"],
                                  "expires": "2026-11-25T11:00:00+00:00"}  # fmt: skip
    record = TokenRecord.from_entry(entry)
    assert record is not None and (record.token_id, record.minted_by, record.entry) == ("t", "x", 3)


def test_access_page_says_when_an_issuers_key_refresh_failed() -> None:
    auth = AuthSettings.model_validate(
        {"jwks_cache_dir": "/tmp/jwks", "issuers": [
            {"issuer": "https://idp.example.com", "audience": "inferno",
             "role_claims": ["groups"], "roles": {"admin": ["ops"], "user": ["staff"]}}]}
    )  # fmt: skip
    fetched = 1_764_000_000.0
    failing = KeyStatus(False, ("k1", "k2"), fetched, stale=False, refresh_at=fetched + 300,
                        stale_at=fetched + 43200, last_attempt_at=fetched + 400)  # fmt: skip
    context = {**SIGNED_OUT, "table": sort_and_page([], {"x": str}, {}, "x"),
               "expires_at": None, "own_handle": None, "auth": auth, "revoked": False,
               "key_status": {"https://idp.example.com": failing},
               "role_mappings": {i.issuer: i.role_mapping() for i in auth.issuers},
               "local_issuer": None, "local_role_mapping": LOCAL_ROLE_MAPPING}  # fmt: skip
    page = ConsolePages().render("access.html", context).body.decode()
    text = re.sub(r"<[^>]+>", "", page)
    assert "the last refresh, 2025-11-24 16:06:40 UTC, failed" in text
    assert "refused after 2025-11-25 04:00:00 UTC" in text
    assert "admin ← ops" in text and "user ← staff" in text and "from the claim groups" in text
    assert "k1, k2" in text and "The local issuer is off" in text
