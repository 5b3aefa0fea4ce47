"""The console's login and logout routes: the OIDC authorization code flow with PKCE
(`appliance.auth.oidc_login`) ending in a server-side session (`appliance.auth.sessions`).

GET /console/login redirects to the IdP; GET /console/callback ends the login, records it in
the audit log (a refused one too: appliance.console.sign_in), sets the session cookie and
answers a page of the console that moves on to it (appliance.console); GET
/console/session tells who is logged in and its CSRF token; POST /console/logout (with the CSRF
token) ends the session here and sends the browser to the IdP's end-session endpoint. Access
rules: `appliance.api.access.ROUTE_ACCESS`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from appliance.api.access import session_of
from appliance.api.audit_trail import client_address
from appliance.auth.errors import LoginError
from appliance.auth.oidc_login import LOGIN_COOKIE, PENDING_TTL_S, ConsoleLogin
from appliance.auth.sessions import Session, SessionStore, SessionStoreError, expired_cookie
from appliance.console.errors import ConsoleError
from appliance.console.sign_in import record_refusal, signed_in

if TYPE_CHECKING:  # the console's routes import this module's CurrentSession
    from appliance.console.routes import ConsoleServices

router = APIRouter(prefix="/console", include_in_schema=False)


async def _console_login(request: Request) -> ConsoleLogin:
    login: ConsoleLogin | None = request.app.state.console_login
    if login is None:
        raise ConsoleError(
            404, "console login is not configured (the console_* settings of an auth.issuers)"
        )
    return login


async def _sessions(request: Request) -> SessionStore:
    return request.app.state.sessions


async def _session(request: Request) -> Session:
    session = session_of(request)
    assert session is not None, "AccessControl admits console routes with a session only"
    return session


Login = Annotated[ConsoleLogin, Depends(_console_login)]
Sessions = Annotated[SessionStore, Depends(_sessions)]
CurrentSession = Annotated[Session, Depends(_session)]


@router.get("/login")
async def login(console_login: Login) -> RedirectResponse:
    try:
        url, pending_id = await console_login.begin()
    except LoginError as exc:
        raise ConsoleError(503, f"login is unavailable: {exc}") from None
    response = RedirectResponse(url, status_code=303)
    response.headers.append(
        "set-cookie",
        f"{LOGIN_COOKIE}={pending_id}; Path=/; Max-Age={PENDING_TTL_S}; Secure; HttpOnly; "
        "SameSite=Lax",
    )
    return response


@router.get("/callback")
async def callback(request: Request, console_login: Login, sessions: Sessions) -> HTMLResponse:
    pending_id = request.cookies.get(LOGIN_COOKIE)
    services: ConsoleServices = request.app.state.console
    source = client_address(request.scope)
    try:
        completed = await console_login.complete(pending_id, dict(request.query_params))
    except LoginError as exc:
        await record_refusal(services, f"console login failed: {exc}", source)
        return services.pages.error(400, f"login failed: {exc}; start again at /console/login")
    try:
        session = await asyncio.to_thread(sessions.create, completed.principal, completed.id_token)
    except SessionStoreError:
        return services.pages.error(503, "no session can be stored now; sign in again in a moment")
    details = {"method": "console sign-in (OIDC)", "issuer": completed.principal.issuer}
    response = await signed_in(
        services, session, completed.principal, source, details, "start again at /console/login"
    )
    response.headers.append("set-cookie", f"{LOGIN_COOKIE}=; Path=/; Max-Age=0; Secure; HttpOnly")
    return response


@router.get("/session")
async def current_session(session: CurrentSession) -> dict[str, Any]:
    principal = session.principal
    return {
        "issuer": principal.issuer,
        "subject": principal.subject,
        "roles": sorted(principal.roles),
        "csrf_token": session.csrf_token,
    }


@router.post("/logout")
async def logout(request: Request, session: CurrentSession, sessions: Sessions) -> RedirectResponse:
    await asyncio.to_thread(sessions.delete, session.id)
    console_login: ConsoleLogin | None = request.app.state.console_login
    target = None
    # A session of a one-time sign-in link (appliance.auth.console_ticket) has no ID token:
    # there is no session at an identity provider to end.
    if console_login is not None and session.id_token:
        with contextlib.suppress(LoginError):  # the session here is over either way
            target = await console_login.logout_url(session.id_token)
    signed_out = "/console/login" if console_login is not None else "/console/"
    response = RedirectResponse(target or signed_out, status_code=303)
    response.headers.append("set-cookie", expired_cookie())
    return response
