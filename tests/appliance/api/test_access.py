"""Every route behind its access rule: a table-driven walk over the app's own routes proves that
none answers without its role, and refusals keep their contract (401 or 403 in OpenAI's error
shape, an RFC 6750 challenge, an audit entry that the response names)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import BaseRoute, Route

from appliance.api.access import CSRF_HEADER, ROUTE_ACCESS
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE
from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.test_audit_trail import AuditDatabase

REFUSED = {401, 403}
USER, SERVICE, ADMIN, AUDITOR = Role.USER, Role.SERVICE, Role.ADMIN, Role.AUDITOR

# The access policy, written out independently of appliance.api.access.ROUTE_ACCESS: the test
# holds the server to it. "public" needs no credentials; a set of roles needs a bearer token
# with one of them; ("console", roles) a console session with one of them.
EXPECTED: dict[str, Any] = {
    "/live": "public",
    "/health": "public",
    "/v1/models": {USER, SERVICE, ADMIN},
    "/v1/models/{model_id}": {USER, SERVICE, ADMIN},
    "/v1/completions": {USER, SERVICE},
    "/v1/chat/completions": {USER, SERVICE},
    "/v1/responses": {USER, SERVICE},
    "/v1/audit/proof/{index}": {USER, SERVICE, AUDITOR},  # not admins: separation of duties
    "/v1/attestation": "public",  # clients attest the appliance before sending it a token
    "/metrics": {ADMIN},
    "/openapi.json": "public",  # the schema holds no secret; clients read it before a token
    "/console/login": "public",
    "/console/callback": "public",
    "/console/login/local": "public",  # the one-time link's signed ticket authenticates
    "/console/session": ("console", set(Role)),
    "/console/logout": ("console", set(Role)),
    "/console/static/{name}": "public",  # stylesheet and script, which sign-in pages need too
    "/console/": ("console", {ADMIN, AUDITOR}),  # auditors are sent on to their first page
    "/console/overview/series": ("console", {ADMIN}),  # the Overview's charts: admins only
    "/console/attestation": ("console", {ADMIN, AUDITOR}),
    "/console/attestation/reattest": ("console", {ADMIN}),
    "/console/attestation/history": ("console", {ADMIN, AUDITOR}),
    "/console/attestation/evidence": ("console", {ADMIN, AUDITOR}),
    "/console/audit": ("console", {ADMIN, AUDITOR}),
    "/console/audit/{index}": ("console", {ADMIN, AUDITOR}),
    "/console/checkpoints": ("console", {ADMIN, AUDITOR}),
    "/console/export": ("console", {ADMIN, AUDITOR}),  # auditors verify what they export
    "/console/usage": ("console", {ADMIN}),
    "/console/usage/csv": ("console", {ADMIN}),
    "/console/access": ("console", {ADMIN}),
    "/console/access/sessions/{handle}/revoke": ("console", {ADMIN}),
    "/console/access/tokens": ("console", {ADMIN}),
    "/console/system": ("console", {ADMIN}),
    "/console/system/drain": ("console", {ADMIN}),
}
_PARAMETERS = {"model_id": MODEL_NAME, "index": "0", "name": "console.css", "handle": "0" * 64}


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The API tests' server, with a budget of audited refusals large enough that each of
    this module's refusals gets an entry of its own (the rate limit has its own tests)."""
    directory = tmp_path_factory.mktemp("access")
    auth = {
        "local_issuer": "demo",
        "local_issuer_key_file": str(directory / "local-issuer.pem"),
        "failure_events_per_minute": 10_000,
    }
    with running_server(make_settings(directory, smollm2_dir, auth=auth), api_engine) as running:
        yield running


def _walk(routes: Iterable[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(path template, method) of each route, through included routers (FastAPI keeps them
    as one entry with the router's own routes)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _walk(included.routes, prefix + route.include_context.prefix)
            continue
        assert isinstance(route, Route), f"a route of unexpected type: {route!r}"
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                yield prefix + route.path, method


def app_routes(app: FastAPI) -> list[tuple[str, str]]:
    return list(_walk(app.routes))


def _url(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: _PARAMETERS[m.group(1)], path)


def _call(http: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    if method == "POST":
        kwargs.setdefault("json", {})  # wrong for every route: 400 once admitted, nothing runs
    return http.request(method, _url(path), follow_redirects=False, **kwargs)


def test_every_route_has_an_access_rule_and_every_rule_a_route(server: RunningServer) -> None:
    routes = {path for path, _ in app_routes(server.app)}
    assert routes == set(ROUTE_ACCESS) == set(EXPECTED)
    assert ("GET", "/docs") not in {(m, p) for p, m in app_routes(server.app)}


def _verdict(status: int) -> int | str:
    return status if status in REFUSED else "allowed"


def _session_headers(server: RunningServer, role: Role) -> dict[str, str]:
    principal = Principal("urn:test", f"a-{role}", None, frozenset({role}), 0.0)
    session = server.app.state.sessions.create(principal, "id.token.hint")
    return {"Cookie": f"{SESSION_COOKIE}={session.id}", CSRF_HEADER: session.csrf_token}


def test_no_route_answers_without_its_role(server: RunningServer) -> None:
    problems = []
    with server.http(role=None) as http:
        for path, method in app_routes(server.app):
            rule = EXPECTED[path]
            where = f"{method} {path}"
            anonymous = _call(http, method, path)
            if rule == "public":
                if anonymous.status_code in REFUSED:
                    problems.append(f"{where} is public, yet refused {anonymous.status_code}")
                continue
            if anonymous.status_code != 401 or "Bearer realm=" not in anonymous.headers.get(
                "WWW-Authenticate", ""
            ):
                problems.append(f"{where} answered {anonymous.status_code} without credentials")
            for role in Role:
                token = {"Authorization": f"Bearer {server.token(role)}"}
                status = _call(http, method, path, headers=token).status_code
                # A token opens no console session.
                expected = 401 if isinstance(rule, tuple) else "allowed" if role in rule else 403
                if _verdict(status) != expected:
                    problems.append(f"{where} answered {status} to a {role} token")
                if isinstance(rule, tuple):
                    headers = _session_headers(server, role)
                    status = _call(http, method, path, headers=headers).status_code
                    if _verdict(status) != ("allowed" if role in rule[1] else 403):
                        problems.append(f"{where} answered {status} to a {role} session")
    assert problems == []


def test_console_state_change_needs_the_sessions_csrf_token(server: RunningServer) -> None:
    headers = _session_headers(server, Role.ADMIN)
    with server.http(role=None) as http:
        for csrf in (None, "wrong"):
            sent = {**headers, CSRF_HEADER: csrf} if csrf else {"Cookie": headers["Cookie"]}
            response = http.post("/console/logout", headers=sent)
            assert response.status_code == 403
            assert "CSRF" in response.text  # the console's error page
        assert (
            http.get("/console/session", headers={"Cookie": headers["Cookie"]}).status_code == 200
        )


def test_paths_without_a_rule_do_not_exist_even_if_a_route_is_added(server: RunningServer) -> None:
    async def unruled() -> dict[str, str]:
        return {"reached": "yes"}

    server.app.add_api_route("/v1/unruled", unruled)
    try:
        with server.http(Role.ADMIN) as http:
            response = http.get("/v1/unruled")
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "Invalid URL (GET /v1/unruled)"
    finally:
        server.app.router.routes.pop()


def test_unauthenticated_request_is_refused_before_its_body_is_read(server: RunningServer) -> None:
    with server.http(role=None) as http:
        response = http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="inferno"'
    error = response.json()["error"]
    assert error["code"] == "invalid_token"
    assert error["message"] == "authentication required: no bearer token"


def test_refusals_are_audited_and_the_response_names_their_entry(server: RunningServer) -> None:
    with server.http(role=None) as http:
        bad = http.get("/v1/models", headers={"Authorization": "Bearer a.b.c"})
    with server.http(Role.AUDITOR) as http:
        denied = http.get("/v1/models")
    assert bad.status_code == 401
    assert bad.headers["WWW-Authenticate"] == (
        'Bearer realm="inferno", error="invalid_token", error_description="malformed token"'
    )
    assert denied.status_code == 403
    assert 'error="insufficient_scope"' in denied.headers["WWW-Authenticate"]
    database = AuditDatabase(server)
    for response, action in ((bad, "auth.authenticate"), (denied, "auth.authorize")):
        _, index, _ = response.headers["Audit-Entry"].split(" ")
        entry = database.entry(int(index))
        assert entry["action"] == action
        assert entry["outcome"] == ("failure" if response.status_code == 401 else "denied")
    assert database.entry(int(bad.headers["Audit-Entry"].split(" ")[1]))["details"] == {
        "reason": "malformed token"
    }


def test_the_openapi_schema_is_public_and_names_the_bearer_scheme(server: RunningServer) -> None:
    with server.http(role=None) as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]
