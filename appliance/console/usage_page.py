"""The console's Usage page (admins): requests and tokens per principal or per role over a
chosen period, from the audit log (appliance.console.usage), sorted and paged, and the same
rows as a CSV download, which is audited as `admin.usage.export` before it is produced."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from appliance.console.errors import ConsoleError
from appliance.console.forms import read_form
from appliance.console.routes import (
    ConsoleServices,
    Services,
    Viewer,
    record_admin_action,
    render,
)
from appliance.console.table import TablePage, sort_and_page
from appliance.console.usage import (
    MAX_PERIOD,
    SORT_KEYS,
    Usage,
    UsagePeriod,
    UsageQueryError,
    read_usage,
    to_csv,
)
from audit.errors import AuditError

router = APIRouter(prefix="/console", include_in_schema=False)

GROUPS = {"principal": "Principal", "role": "Role"}


@router.get("/usage")
async def usage(request: Request, services: Services, session: Viewer) -> Response:
    params = request.query_params
    by = params.get("by", "principal")
    if by not in GROUPS:
        raise ConsoleError(400, "by must be principal or role")
    period = _period(params)
    tallied = await _read(services, period)
    rows = tallied.by_principal if by == "principal" else tallied.by_role
    table = sort_and_page(rows, SORT_KEYS, params, "requests", default_descending=True)
    _check_page(params, table)
    base = {**period.form_values(), "by": by}

    def href(**changes: object) -> str:
        return "?" + urlencode({**base, **{k: str(v) for k, v in changes.items()}})

    return render(
        services, session, "usage", "usage.html",
        form=base, period=period, groups=GROUPS, by=by, usage=tallied, table=table, href=href,
        max_days=MAX_PERIOD.days,
    )  # fmt: skip


@router.post("/usage/csv")
async def usage_csv(request: Request, services: Services, session: Viewer) -> Response:
    period = _period(await read_form(request))
    tallied = await _read(services, period)
    target = {"since": period.since.isoformat(), "until": period.until.isoformat()}
    await record_admin_action(request, services, session, "usage.export", target)
    name = f"usage-{period.since:%Y%m%dT%H%M}-{period.until:%Y%m%dT%H%M}.csv"
    headers = {**services.pages.headers, "Content-Disposition": f'attachment; filename="{name}"'}
    return Response(to_csv(tallied), media_type="text/csv; charset=utf-8", headers=headers)


def _period(params: Mapping[str, str]) -> UsagePeriod:
    try:
        return UsagePeriod.parse(params, datetime.now(UTC))
    except UsageQueryError as exc:
        raise ConsoleError(400, str(exc)) from None


async def _read(services: ConsoleServices, period: UsagePeriod) -> Usage:
    try:
        return await asyncio.to_thread(read_usage, services.trail.log.store, period)
    except UsageQueryError as exc:
        raise ConsoleError(400, str(exc)) from None
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None


def _check_page(params: Mapping[str, str], table: TablePage[object]) -> None:
    """Refuse a page number that is not one of the table's (the table would show its first)."""
    text = params.get("page")
    if text is not None and (not text.isdigit() or not 1 <= int(text) <= table.num_pages):
        raise ConsoleError(
            400, f"page must be a number from 1 to {table.num_pages}; this table has no page "
            f"{text[:20]!r}"
        )  # fmt: skip
