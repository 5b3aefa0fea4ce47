"""The Access page's tokens of the local issuer (where `auth.local_issuer` enables it): the
list of tokens issued, and minting one.

The appliance keeps no token, and no second record of one: the list is read from the audit
log's `admin.token.issue` entries (those of `inferno token` and of the demo too), which name
each token's id, subject, roles, expiry and who had it made. Reading the list is itself
recorded (`admin.token.list`) before it is shown. Minting (user, service or admin tokens:
never auditor, which an admin does not grant) plans the token, records its issue naming the
admin, and only then signs it (appliance.auth.local_issuer); the token is shown
once, in the answer to the form, and nowhere else.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import Response

from appliance.auth.local_issuer import TOKEN_ISSUE, LocalIssuer, TokenRequestError
from appliance.auth.roles import Role
from appliance.console.audit_search import AuditQuery, search
from appliance.console.errors import ConsoleError
from appliance.console.routes import (
    ConsoleServices,
    Services,
    Viewer,
    record_admin_action,
    render,
)
from appliance.console.table import sort_and_page
from audit.errors import AuditError

router = APIRouter(prefix="/console/access", include_in_schema=False)

TOKEN_LIST = "token.list"
# An admin grants no auditor token: the auditor role reads what admins do, and is granted by
# the identity provider (or `inferno token` on the host), never by an admin (separation of
# duties, appliance.auth.roles).
MINTABLE_ROLES = (Role.USER, Role.SERVICE, Role.ADMIN)
# Every token issued within the longest lifetime is found, if the log's newest entries of that
# span hold it; a page lists this many at most.
MAX_LISTED = 1000


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A token as its `admin.token.issue` entry records it (never the token)."""

    token_id: str
    subject: str
    roles: tuple[str, ...]
    issued_at: datetime
    expires_at: datetime
    minted_by: str
    # The entry's position in the audit log.
    entry: int

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> TokenRecord | None:
        """The record an `admin.token.issue` entry holds; None for one that holds none."""
        try:
            return cls._from_entry(entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    @classmethod
    def _from_entry(cls, entry: dict[str, Any]) -> TokenRecord:
        target, actor = entry["details"]["target"], entry["actor"]
        by = actor["subject"] or "unknown"
        if actor.get("client"):
            by += f" ({actor['client']})"
        return cls(
            token_id=target["token_id"],
            subject=target["subject"],
            roles=tuple(target["roles"]),
            issued_at=datetime.fromisoformat(entry["time"]),
            expires_at=datetime.fromisoformat(target["expires"]),
            minted_by=by,
            entry=entry["index"],
        )


def _local_issuer(services: ConsoleServices) -> LocalIssuer:
    if services.local_issuer is None:
        raise ConsoleError(
            404, "the local issuer is off (auth.local_issuer): tokens come from the identity "
            "provider",
        )  # fmt: skip
    return services.local_issuer


@router.get("/tokens")
async def tokens(request: Request, services: Services, session: Viewer) -> Response:
    issuer = _local_issuer(services)
    now = datetime.now(UTC)
    since = now - timedelta(seconds=issuer.token_ttl_s)
    await record_admin_action(request, services, session, TOKEN_LIST,
                               {"issued_since": since.isoformat()})  # fmt: skip
    records, complete = await _issued_since(services, since)
    table = sort_and_page(
        records,
        {
            "subject": lambda r: r.subject,
            "issued": lambda r: r.issued_at,
            "expires": lambda r: r.expires_at,
            "minted_by": lambda r: r.minted_by,
        },
        request.query_params,
        "issued",
        default_descending=True,
    )
    return render(
        services, session, "access", "tokens.html",
        table=table, now=now, complete=complete, **_form_context(issuer),
    )  # fmt: skip


@router.post("/tokens")
async def mint(request: Request, services: Services, session: Viewer) -> Response:
    issuer = _local_issuer(services)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    subject = form.get("subject", [""])[0].strip()
    roles = _roles(form.get("role", []))
    ttl_s = _lifetime_s(form.get("lifetime_min", [""])[0], issuer)
    try:
        issued = issuer.plan(roles, subject, time.time(), ttl_s)
    except TokenRequestError as exc:
        raise ConsoleError(400, f"no token was made: {exc}") from None
    await record_admin_action(request, services, session, TOKEN_ISSUE, issued.audit_target())
    return render(
        services, session, "access", "token_minted.html",
        token=issuer.sign(issued), issued=issued,
        issued_at=datetime.fromtimestamp(issued.issued_at, UTC),
        expires_at=datetime.fromtimestamp(issued.expires_at, UTC),
    )  # fmt: skip


def _roles(names: list[str]) -> frozenset[Role]:
    unknown = sorted(set(names) - {role.value for role in Role})
    if unknown:
        raise ConsoleError(400, f"no token was made: {unknown[0]!r} is not a role")
    roles = frozenset(Role(name) for name in names)
    if not roles <= set(MINTABLE_ROLES):
        raise ConsoleError(
            400, "no token was made: admins do not grant the auditor role (separation of "
            "duties); the identity provider grants it",
        )  # fmt: skip
    return roles


def _lifetime_s(text: str, issuer: LocalIssuer) -> int:
    maximum = issuer.token_ttl_s // 60
    text = text.strip()
    # ASCII digits only, and few: int() refuses "²" and numbers of thousands of digits.
    if not re.fullmatch(r"[0-9]{1,6}", text) or not 1 <= int(text) <= maximum:
        raise ConsoleError(
            400, f"no token was made: the lifetime is a whole number of minutes, 1 to {maximum}"
        )
    return int(text) * 60


def _form_context(issuer: LocalIssuer) -> dict[str, Any]:
    return {"roles": MINTABLE_ROLES, "max_lifetime_min": issuer.token_ttl_s // 60}


async def _issued_since(
    services: ConsoleServices, since: datetime
) -> tuple[list[TokenRecord], bool]:
    """The tokens issued since `since`, and whether the search saw every entry of that span."""
    query = AuditQuery(since=since, action=f"admin.{TOKEN_ISSUE}")
    try:
        found = await asyncio.to_thread(search, services.trail.log.store, query, None,
                                        page_size=MAX_LISTED)  # fmt: skip
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    records = [r for e in found.entries if (r := TokenRecord.from_entry(e)) is not None]
    return records, found.next_before is None
