"""Signing into the console with a one-time link of the local issuer (`inferno console-link`;
appliance.auth.console_ticket): GET /console/login/local?ticket=... ends in an ordinary console
session, as the identity provider's login does.

The route exists only where `auth.local_issuer` is on (404 otherwise). The ticket is spent and
its session made in one transaction; the sign-in is then recorded in the audit log
(`auth.authenticate`, naming the ticket's id) before the browser gets the session cookie, and
if it cannot be, the session is ended unused. A link used a second time is refused and recorded
as a failure. Refusals are the console's error page, saying how to get a new link.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from appliance.api.audit_trail import client_address
from appliance.auth.console_ticket import ConsoleTicket, TicketError, verify_console_ticket
from appliance.auth.sessions import SessionStoreError
from appliance.console.errors import ConsoleError
from appliance.console.pages import SIGNED_OUT
from appliance.console.routes import ConsoleServices, Services
from audit.errors import AuditError
from audit.event import Action, AuditEvent, Outcome, authentication_failure

router = APIRouter(prefix="/console", include_in_schema=False)

_NEW_LINK = "run `inferno console-link` where the appliance runs for a new link"


@router.get("/login/local")
async def sign_in_with_link(request: Request, services: Services) -> HTMLResponse:
    issuer = services.local_issuer
    if issuer is None:
        raise ConsoleError(404, "sign-in links need the local issuer (auth.local_issuer)")
    text = request.query_params.get("ticket")
    if not text:
        raise ConsoleError(400, f"this sign-in link holds no ticket; {_NEW_LINK}")
    try:
        ticket = verify_console_ticket(issuer, text, time.time(), services.settings.auth.leeway_s)
    except TicketError as exc:
        raise ConsoleError(400, f"sign-in refused: {exc}; {_NEW_LINK}") from None
    source = client_address(request.scope)
    # A ticket stays usable until its exp plus the leeway; its id is kept that long.
    usable_until = ticket.expires_at + services.settings.auth.leeway_s
    try:
        session = await asyncio.to_thread(
            services.sessions.redeem, ticket.ticket_id, usable_until, ticket.principal
        )
    except SessionStoreError:
        raise ConsoleError(503, "no session can be stored now; try the link again") from None
    if session is None:
        refused = authentication_failure(
            time=datetime.now(UTC), source_address=source, request_id=None,
            reason="sign-in link used again", claimed=ticket.principal.actor(),
        )  # fmt: skip
        await _record(services, refused)
        raise ConsoleError(400, f"sign-in refused: this link was used already; {_NEW_LINK}")
    try:
        await _record(services, _sign_in_event(ticket, source))
    except ConsoleError:
        # The browser never gets this session (no one else knows its id): end it. The ticket
        # stays spent.
        with contextlib.suppress(SessionStoreError):
            await asyncio.to_thread(services.sessions.revoke, session.handle)
        raise ConsoleError(
            503, f"the audit log cannot record this sign-in now, so it was refused; {_NEW_LINK}"
        ) from None
    response = services.pages.render("signed_in.html", SIGNED_OUT)
    response.headers.append("set-cookie", services.sessions.cookie(session))
    return response


def _sign_in_event(ticket: ConsoleTicket, source: str | None) -> AuditEvent:
    return AuditEvent(
        Action.AUTHENTICATE,
        Outcome.SUCCESS,
        datetime.now(UTC),
        ticket.principal.actor(),
        source,
        None,
        {"method": "console sign-in link", "ticket_id": ticket.ticket_id},
    )


async def _record(services: ConsoleServices, event: AuditEvent) -> None:
    try:
        await services.trail.append(event)
    except AuditError:
        raise ConsoleError(
            503, "the audit log cannot record this sign-in now, so it was refused; try again"
        ) from None
