"""Who may call what: every route's access rule in one table, enforced before the route runs
(before its body is even read), with default deny.

A request reaches the router only when its path matches a path template of `ROUTE_ACCESS`,
whose rule says who may call it: `Public` (with the reason it may be), `Bearer` (an API access
token holding one of the roles) or `Console` (a console session holding one of the roles;
state-changing methods must also send the session's CSRF token, in `X-CSRF-Token` or as the
`csrf_token` field of a form). Any other path is answered 404 here, route or not: a route
without a rule does not exist. Refusals are 401 or 403 in OpenAI's error shape with an RFC 6750
`WWW-Authenticate` challenge (under /console/, the console's own HTML page instead), and go to
the audit log through `DenialReporter`.

The authenticated `Principal` is put in the request's state for the routes (`principal_of`),
and its audit `Actor` for the audit trail; a refusal's own audit entry is named as the
request's entry (appliance.api.audit_trail). The path template a request matched is put there
too (`ROUTE_STATE`), for the access log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from fastapi import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.api.audit_trail import ACTOR_STATE, RECEIPT_STATE
from appliance.api.errors import APIError, not_found
from appliance.auth.authenticator import Authenticator
from appliance.auth.denials import DenialReporter
from appliance.auth.errors import AuthenticationError, AuthorizationError, Reason
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE, Session, SessionStore, SessionStoreError
from appliance.auth.www_authenticate import challenge

CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
CONSOLE_PREFIX = "/console/"
# A console form holds a CSRF token and a few short fields; its body is read here, before the
# route's own size limit applies, so it has its own.
MAX_FORM_BYTES = 64 << 10
MAX_FORM_FIELDS = 64
ROUTE_STATE = "route"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
INFERENCE = frozenset({Role.USER, Role.SERVICE})
ANY_ROLE = frozenset(Role)
ADMIN = frozenset({Role.ADMIN})
CONSOLE_VIEWERS = frozenset({Role.ADMIN, Role.AUDITOR})


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
    "/v1/responses": Bearer(INFERENCE),
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
    "/console/login/local": Public(
        "ends a sign-in with a one-time link: the local issuer's signed ticket authenticates"
    ),
    "/console/session": Console(ANY_ROLE),
    "/console/logout": Console(ANY_ROLE),
    # The console's pages (appliance.console): auditors see attestation and the audit log only.
    "/console/static/{name}": Public("the console's stylesheet and script: sign-in pages too"),
    "/console/": Console(CONSOLE_VIEWERS),
    "/console/overview/series": Console(ADMIN),
    "/console/attestation": Console(CONSOLE_VIEWERS),
    "/console/attestation/reattest": Console(ADMIN),
    "/console/attestation/history": Console(CONSOLE_VIEWERS),
    "/console/attestation/evidence": Console(CONSOLE_VIEWERS),
    "/console/audit": Console(CONSOLE_VIEWERS),
    "/console/audit/{index}": Console(CONSOLE_VIEWERS),
    "/console/checkpoints": Console(CONSOLE_VIEWERS),
    # Auditors are export's main users: the bundle is what they verify offline.
    "/console/export": Console(CONSOLE_VIEWERS),
    "/console/usage": Console(ADMIN),
    "/console/usage/csv": Console(ADMIN),
    "/console/access": Console(ADMIN),
    "/console/access/sessions/{handle}/revoke": Console(ADMIN),
    "/console/access/tokens": Console(ADMIN),
    "/console/system": Console(ADMIN),
    "/console/system/drain": Console(ADMIN),
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


ConsolePage = Callable[[int, str], Response]
"""The console's HTML answer with a status and a message (appliance.console)."""


class AccessControl:
    """ASGI middleware applying `rules` (path template -> rule; see the module docstring).
    Refusals under /console/ are answered by `console_page`, when given."""

    def __init__(
        self,
        app: ASGIApp,
        rules: Mapping[str, Rule],
        authenticator: Authenticator,
        sessions: SessionStore,
        denials: DenialReporter[object],
        console_page: ConsolePage | None = None,
    ) -> None:
        self.app = app
        self.rules = [(compile_path(path)[0], path, rule) for path, rule in rules.items()]
        self.authenticator = authenticator
        self.sessions = sessions
        self.denials = denials
        self.console_page = console_page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = next(
            ((path, rule) for regex, path, rule in self.rules if regex.match(scope["path"])), None
        )
        if found is None:
            answer = not_found(scope["method"], scope["path"])
            await self._answer(scope, answer)(scope, receive, send)
            return
        path, rule = found
        state = scope.setdefault("state", {})
        state[ROUTE_STATE] = path
        if not isinstance(rule, Public):
            try:
                principal, receive = await self._admit(scope, receive, path, rule)
            except _Refused as refused:
                if refused.receipt is not None:
                    state[RECEIPT_STATE] = refused.receipt
                await self._answer(scope, _refusal(refused.error))(scope, receive, send)
                return
            except SessionStoreError:
                unavailable = APIError(
                    503, "console sessions cannot be read now; retry shortly", type="server_error"
                )
                await self._answer(scope, unavailable)(scope, receive, send)
                return
            state["principal"] = principal
            state[ACTOR_STATE] = principal.actor()
        await self.app(scope, receive, send)

    def _answer(self, scope: Scope, error: APIError) -> ASGIApp:
        if self.console_page is not None and scope["path"].startswith(CONSOLE_PREFIX):
            page = self.console_page(error.status, error.message)
            page.headers.update(error.headers)  # a 401's WWW-Authenticate (RFC 9110 15.5.2)
            return page
        return error.response()

    async def _admit(
        self, scope: Scope, receive: Receive, path: str, rule: Bearer | Console
    ) -> tuple[Principal, Receive]:
        """The principal allowed to call `path`, and the `receive` the route reads its body
        from; raises `_Refused` after reporting why not."""
        source = scope["client"][0] if scope.get("client") else None
        resource = f"{scope['method']} {path}"
        principal: Principal | None = None
        try:
            if isinstance(rule, Console):
                session = await self._session(scope)
                scope["state"]["session"] = session
                principal = session.principal
            else:
                principal = await self.authenticator.authenticate(
                    _header_values(scope, b"authorization")
                )
            if not principal.has_any(rule.roles):
                raise AuthorizationError(f"{resource} needs the role {_either(rule.roles)}")
            if isinstance(rule, Console) and scope["method"] not in _SAFE_METHODS:
                token, receive = await _csrf_token(scope, receive)
                session.verify_csrf(token)
        except AuthenticationError as exc:
            receipt = await self.denials.authentication_failed(exc, source, None)
            raise _Refused(exc, receipt) from None
        except AuthorizationError as exc:
            receipt = await self.denials.authorization_denied(
                principal, source, None, resource, rule.roles
            )
            raise _Refused(exc, receipt) from None
        return principal, receive

    async def _session(self, scope: Scope) -> Session:
        cookies = SimpleCookie()
        try:
            for value in _header_values(scope, b"cookie"):
                cookies.load(value)
        except CookieError:
            raise AuthenticationError(Reason.NO_SESSION) from None
        morsel = cookies.get(SESSION_COOKIE)
        session = None
        if morsel is not None and morsel.value:
            session = await asyncio.to_thread(self.sessions.get, morsel.value)
        if session is None:
            raise AuthenticationError(Reason.NO_SESSION)
        return session


async def _csrf_token(scope: Scope, receive: Receive) -> tuple[str | None, Receive]:
    """The CSRF token a state-changing console request sent: its one `X-CSRF-Token` header, or
    else its form's one `csrf_token` field (the body is read here, within MAX_FORM_BYTES, and
    replayed to the route). None when it sent none, or several."""
    tokens = _header_values(scope, CSRF_HEADER.encode())
    content_type = next(iter(_header_values(scope, b"content-type")), "")
    if tokens or content_type.split(";")[0].strip() != "application/x-www-form-urlencoded":
        return (tokens[0] if len(tokens) == 1 else None), receive
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None, receive
        body += message.get("body", b"")
        if len(body) > MAX_FORM_BYTES:
            return None, receive
        if not message.get("more_body", False):
            break
    try:
        fields = parse_qs(body.decode("latin-1"), max_num_fields=MAX_FORM_FIELDS)
    except ValueError:  # more fields than any console form has
        return None, receive
    values = fields.get(CSRF_FIELD, [])
    return (values[0] if len(values) == 1 else None), _replay(bytes(body), receive)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the route `body` (already read), then what `receive` says."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _Refused(Exception):
    def __init__(self, error: AuthenticationError | AuthorizationError, receipt: object) -> None:
        self.error = error
        self.receipt = receipt


def _header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


def _either(roles: frozenset[Role]) -> str:
    return " or ".join(sorted(roles))


def _refusal(exc: AuthenticationError | AuthorizationError) -> APIError:
    headers = {"WWW-Authenticate": challenge(exc)}
    if isinstance(exc, AuthorizationError):
        return APIError(403, str(exc), code="insufficient_role", headers=headers)
    message = f"authentication required: {exc.reason}"
    return APIError(401, message, code="invalid_token", headers=headers)
