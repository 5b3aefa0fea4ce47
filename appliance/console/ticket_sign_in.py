"""Signing into the console with a one-time link of the local issuer (`inferno console-link`;
appliance.auth.console_ticket): GET /console/login/local?ticket=... ends in an ordinary console
session, as the identity provider's login does.

The route exists only where `auth.local_issuer` is on (404 otherwise). The ticket is spent and
its session made in one transaction; the sign-in is then recorded in the audit log
(`auth.authenticate`, naming the ticket's id) before the browser gets the session cookie, and
if it cannot be, the session is ended unused (appliance.console.sign_in). A link that is used a
second time, expired, forged or not a ticket at all is refused and recorded as a failure.
Refusals are the console's error page, saying how to get a new link.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from appliance.api.audit_trail import client_address
from appliance.auth.console_ticket import TicketError, verify_console_ticket
from appliance.auth.sessions import SessionStoreError
from appliance.console.errors import ConsoleError
from appliance.console.routes import Services
from appliance.console.sign_in import record_refusal, signed_in

router = APIRouter(prefix="/console", include_in_schema=False)

_NEW_LINK = "run `inferno console-link` where the appliance runs for a new link"


@router.get("/login/local")
async def sign_in_with_link(request: Request, services: Services) -> HTMLResponse:
    issuer = services.local_issuer
    if issuer is None:
        raise ConsoleError(404, "sign-in links need the local issuer (auth.local_issuer)")
    source = client_address(request.scope)
    text = request.query_params.get("ticket")
    if not text:
        await record_refusal(services, "sign-in link without a ticket", source)
        raise ConsoleError(400, f"this sign-in link holds no ticket; {_NEW_LINK}")
    try:
        ticket = verify_console_ticket(issuer, text, time.time(), services.settings.auth.leeway_s)
    except TicketError as exc:
        await record_refusal(services, f"sign-in link refused: {exc}", source)
        raise ConsoleError(400, f"sign-in refused: {exc}; {_NEW_LINK}") from None
    # A ticket stays usable until its exp plus the leeway; its id is kept that long.
    usable_until = ticket.expires_at + services.settings.auth.leeway_s
    try:
        session = await asyncio.to_thread(
            services.sessions.redeem, ticket.ticket_id, usable_until, ticket.principal
        )
    except SessionStoreError:
        raise ConsoleError(503, "no session can be stored now; try the link again") from None
    if session is None:
        await record_refusal(services, "sign-in link used again", source, ticket.principal.actor())
        raise ConsoleError(400, f"sign-in refused: this link was used already; {_NEW_LINK}")
    # The ticket stays spent if the log cannot record the sign-in.
    details = {"method": "console sign-in link", "ticket_id": ticket.ticket_id}
    return await signed_in(services, session, ticket.principal, source, details, _NEW_LINK)
