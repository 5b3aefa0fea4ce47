"""Who may call what: every route's access rule in one table, enforced before the route runs
(before its body is even read), with default deny.

A request reaches the router only when its path matches a path template of `ROUTE_ACCESS`,
whose rule says who may call it: `Public` (with the reason it may be), `Bearer` (an API access
token holding one of the roles) or `Console` (a console session holding one of the roles;
state-changing methods must also send the session's CSRF token in `X-CSRF-Token`). Any other
path is answered 404 here, route or not: a route without a rule does not exist. Refusals are
401 or 403 in OpenAI's error shape with an RFC 6750 `WWW-Authenticate` challenge, and go to the
audit log through `DenialReporter`.

The authenticated `Principal` is put in the request's state for the routes (`principal_of`),
and its audit `Actor` for the audit trail; a refusal's own audit entry is named as the
request's entry (appliance.api.audit_trail). The path template a request matched is put there
too (`ROUTE_STATE`), for the access log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Any

from fastapi import Request
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from appliance.api.audit_trail import ACTOR_STATE, RECEIPT_STATE
from appliance.api.errors import APIError
from appliance.auth.authenticator import Authenticator
from appliance.auth.denials import DenialReporter
from appliance.auth.errors import AuthenticationError, AuthorizationError, Reason
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE, Session, SessionStore
from appliance.auth.www_authenticate import challenge

CSRF_HEADER = "x-csrf-token"
ROUTE_STATE = "route"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
INFERENCE = frozenset({Role.USER, Role.SERVICE})
ANY_ROLE = frozenset(Role)


@dataclass(frozen=True, slots=True)
class Public:
    why: str


@dataclass(frozen=True, slots=True)
class Bearer:
    roles: frozenset[Role]


@dataclass(frozen=True, slots=True)
class Console:
    roles: frozenset[Role]


Rule = Public | Bearer | Console

ROUTE_ACCESS: Mapping[str, Rule] = {
    "/live": Public("liveness probes of load balancers and orchestrators carry no token"),
    "/health": Public("readiness probes carry no token; it tells only whether the model serves"),
    "/v1/models": Bearer(INFERENCE | {Role.ADMIN}),
    "/v1/models/{model_id}": Bearer(INFERENCE | {Role.ADMIN}),
    "/v1/completions": Bearer(INFERENCE),
    "/v1/chat/completions": Bearer(INFERENCE),
    "/metrics": Bearer(frozenset({Role.ADMIN})),
    # A receipt for an entry a response named: hashes only, for callers and auditors (not admins).
    "/v1/audit/proof/{index}": Bearer(INFERENCE | {Role.AUDITOR}),
    # Clients verify the appliance before they trust it with a token; evidence, verdicts and
    # the attestation key are public by nature, and collections run one at a time.
    "/v1/attestation": Public("clients attest the appliance before sending it a token"),
    "/openapi.json": Public(
        "the schema describes the API and holds no secret; clients and their generators read "
        "it before they have a token, as from any OpenAI-compatible server"
    ),
    "/console/login": Public("starts a login: the IdP authenticates"),
    "/console/callback": Public("ends a login: the code, state and PKCE verifier authenticate"),
    "/console/session": Console(ANY_ROLE),
    "/console/logout": Console(ANY_ROLE),
}


def document_access(schema: dict[str, Any]) -> None:
    """Add to an OpenAPI schema the bearer scheme, and the 401 and 403 answers of every
    operation that is not public (whose responses refer to `ErrorResponse`)."""
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    refusals = {
        "401": {"description": "no valid bearer token (WWW-Authenticate says why)",
                "content": {"application/json": {"schema": error}}},
        "403": {"description": "the token lacks the role this route needs",
                "content": {"application/json": {"schema": error}}},
    }  # fmt: skip
    for path, operations in schema["paths"].items():
        if not isinstance(ROUTE_ACCESS.get(path), Public):
            for operation in operations.values():
                operation["responses"].update(refusals)
                operation["security"] = [{"bearer": []}]
    schemes = schema["components"].setdefault("securitySchemes", {})
    schemes["bearer"] = {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}


def principal_of(request: Request) -> Principal | None:
    """The caller `AccessControl` authenticated (None on a public route)."""
    return request.scope.get("state", {}).get("principal")


def session_of(request: Request) -> Session | None:
    """The console session of a `Console` route's caller."""
    return request.scope.get("state", {}).get("session")


class AccessControl:
    """ASGI middleware applying `rules` (path template -> rule; see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        rules: Mapping[str, Rule],
        authenticator: Authenticator,
        sessions: SessionStore,
        denials: DenialReporter[object],
    ) -> None:
        self.app = app
        self.rules = [(compile_path(path)[0], path, rule) for path, rule in rules.items()]
        self.authenticator = authenticator
        self.sessions = sessions
        self.denials = denials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = next(
            ((path, rule) for regex, path, rule in self.rules if regex.match(scope["path"])), None
        )
        if found is None:
            not_found = APIError(404, f"Invalid URL ({scope['method']} {scope['path']})")
            await not_found.response()(scope, receive, send)
            return
        path, rule = found
        state = scope.setdefault("state", {})
        state[ROUTE_STATE] = path
        if not isinstance(rule, Public):
            try:
                principal = await self._admit(scope, path, rule)
            except _Refused as refused:
                if refused.receipt is not None:
                    state[RECEIPT_STATE] = refused.receipt
                await _refusal(refused.error)(scope, receive, send)
                return
            state["principal"] = principal
            state[ACTOR_STATE] = principal.actor()
        await self.app(scope, receive, send)

    async def _admit(self, scope: Scope, path: str, rule: Bearer | Console) -> Principal:
        """The principal allowed to call `path`; raises `_Refused` after reporting why not."""
        source = scope["client"][0] if scope.get("client") else None
        resource = f"{scope['method']} {path}"
        principal: Principal | None = None
        try:
            if isinstance(rule, Console):
                session = self._session(scope)
                scope["state"]["session"] = session
                principal = session.principal
            else:
                principal = await self.authenticator.authenticate(
                    _header_values(scope, b"authorization")
                )
            if not principal.has_any(rule.roles):
                raise AuthorizationError(f"{resource} needs the role {_either(rule.roles)}")
            if isinstance(rule, Console) and scope["method"] not in _SAFE_METHODS:
                tokens = _header_values(scope, CSRF_HEADER.encode())
                session.verify_csrf(tokens[0] if len(tokens) == 1 else None)
        except AuthenticationError as exc:
            receipt = await self.denials.authentication_failed(exc, source, None)
            raise _Refused(exc, receipt) from None
        except AuthorizationError as exc:
            receipt = await self.denials.authorization_denied(
                principal, source, None, resource, rule.roles
            )
            raise _Refused(exc, receipt) from None
        return principal

    def _session(self, scope: Scope) -> Session:
        cookies = SimpleCookie()
        try:
            for value in _header_values(scope, b"cookie"):
                cookies.load(value)
        except CookieError:
            raise AuthenticationError(Reason.NO_SESSION) from None
        morsel = cookies.get(SESSION_COOKIE)
        session = self.sessions.get(morsel.value) if morsel is not None else None
        if session is None:
            raise AuthenticationError(Reason.NO_SESSION)
        return session


class _Refused(Exception):
    def __init__(self, error: AuthenticationError | AuthorizationError, receipt: object) -> None:
        self.error = error
        self.receipt = receipt


def _header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


def _either(roles: frozenset[Role]) -> str:
    return " or ".join(sorted(roles))


def _refusal(exc: AuthenticationError | AuthorizationError) -> ASGIApp:
    headers = {"WWW-Authenticate": challenge(exc)}
    if isinstance(exc, AuthorizationError):
        return APIError(403, str(exc), code="insufficient_role", headers=headers).response()
    message = f"authentication required: {exc.reason}"
    return APIError(401, message, code="invalid_token", headers=headers).response()
