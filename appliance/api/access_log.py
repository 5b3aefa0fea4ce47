"""The access log: one line per HTTP request, once its response has ended (`log.access`).

Each line holds the method, the route (the path template the request matched in
appliance.api.access, `/v1/audit/proof/{index}`; `-` for a path that matched none), the status,
the latency in milliseconds, who called (the issuer and subject that access control
established; `-` on a public route or a refusal), and the index of the audit entry that records
the request (`Audit-Entry`, under `/v1/`). Never the path as sent, the query string, a header,
a body, a token or a prompt: the audit log holds what an investigation needs, as commitments.
With `log.format = "json"` the same values are keys of the line's object (appliance.logs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.api.access import ROUTE_STATE
from appliance.api.middleware import AUDIT_ENTRY_HEADER
from appliance.auth.principal import Principal
from appliance.logs import FIELDS

logger = logging.getLogger(__name__)


class AccessLog:
    """ASGI middleware writing the access log. It must wrap every other middleware, so that
    the answers they give by themselves (401, 403, 404, 413, a 503 of the audit log) are logged
    with the status the client saw."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.perf_counter()
        status: int | None = None
        audit_entry: int | None = None

        def send_and_note(message: Message) -> Awaitable[None]:
            # Plain, not async: a body message costs one call (appliance.api.middleware).
            nonlocal status, audit_entry
            if message["type"] == "http.response.start":
                status = message["status"]
                audit_entry = _audit_index(message)
            return send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            if status is None:
                status = 500  # what the outermost error handler answers
            raise
        finally:
            _log(scope, status, (time.perf_counter() - started_s) * 1000, audit_entry)


def _audit_index(start: Message) -> int | None:
    for name, value in start.get("headers", ()):
        if name == AUDIT_ENTRY_HEADER:
            _, index, _ = value.decode("ascii").split(" ")
            return int(index)
    return None


def _log(scope: Scope, status: int | None, latency_ms: float, audit_entry: int | None) -> None:
    state = scope.get("state", {})
    principal: Principal | None = state.get("principal")
    fields = {
        "method": scope["method"],
        "route": state.get(ROUTE_STATE),
        "status": status,
        "latency_ms": round(latency_ms, 1),
        "issuer": None if principal is None else principal.issuer,
        "subject": None if principal is None else principal.subject,
        "audit_entry": audit_entry,
    }
    shown = {key: "-" if value is None else value for key, value in fields.items()}
    logger.info(
        "%(method)s %(route)s %(status)s %(latency_ms).1fms issuer=%(issuer)s "
        "subject=%(subject)s audit_entry=%(audit_entry)s",
        shown,
        extra={FIELDS: fields},
    )
