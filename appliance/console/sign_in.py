"""The last step of every console sign-in, through the identity provider
(appliance.api.console_login) or a one-time link (appliance.console.ticket_sign_in): the
sign-in goes into the audit log (`auth.authenticate`) before the browser gets its session
cookie, and a refused sign-in goes there too, rate-limited per address like refused tokens
(appliance.auth.denials).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from fastapi.responses import HTMLResponse

from appliance.auth.principal import Principal
from appliance.auth.sessions import Session, SessionStoreError
from appliance.console.errors import ConsoleError
from appliance.console.pages import SIGNED_OUT
from audit.canonical import JsonValue
from audit.errors import AuditError
from audit.event import Action, Actor, AuditEvent, Outcome, authentication_failure

if TYPE_CHECKING:  # routes imports the login routes, which import this module
    from appliance.console.routes import ConsoleServices

# A refusal's reason can quote what the identity provider or the link said: bounded.
_MAX_REASON_CHARS = 300


async def signed_in(
    services: ConsoleServices,
    session: Session,
    principal: Principal,
    source: str | None,
    details: Mapping[str, JsonValue],
    retry: str,
) -> HTMLResponse:
    """Record the sign-in of `session`, then answer the page that sets its cookie. If the log
    cannot record it, the session is ended unused (no one else knows its id) and the sign-in
    is refused with 503, `retry` saying what to do."""
    event = AuditEvent(
        Action.AUTHENTICATE, Outcome.SUCCESS, datetime.now(UTC), principal.actor(), source, None,
        dict(details),
    )  # fmt: skip
    try:
        await services.trail.append(event)
    except AuditError:
        with contextlib.suppress(SessionStoreError):
            await asyncio.to_thread(services.sessions.revoke, session.handle)
        raise ConsoleError(
            503, f"the audit log cannot record this sign-in now, so it was refused; {retry}"
        ) from None
    response = services.pages.render("signed_in.html", SIGNED_OUT)
    response.headers.append("set-cookie", services.sessions.cookie(session))
    return response


async def record_refusal(
    services: ConsoleServices, reason: str, source: str | None, claimed: Actor | None = None
) -> None:
    """Put a refused sign-in in the audit log (rate-limited per address; the refusal stands
    whether or not it could be recorded)."""
    if len(reason) > _MAX_REASON_CHARS:
        reason = reason[: _MAX_REASON_CHARS - 1] + "…"
    event = authentication_failure(
        time=datetime.now(UTC), source_address=source, request_id=None, reason=reason,
        claimed=claimed or Actor(),
    )  # fmt: skip
    await services.denials.report(event, source, f"refused a console sign-in from {source}")
