"""The console's audit export (admins and auditors): a range of the log, by position or by time,
as the bundle `inferno audit export --tar` writes (audit.export), to verify offline with
`python -m audit verify`; and the SIEM feed's status.

An export is recorded twice, both before the bundle is written: first `admin.audit.export`
naming whoever asked (as every console action is; if the log cannot store it the export is
refused), then the export's own `audit.export` entry, which `export_bundle` appends and the
bundle's manifest names (`export_entry`). A range is checked before anything is recorded, and
may hold at most MAX_EXPORT_ENTRIES entries; larger ones are exported on the appliance with
`inferno audit export`.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask

from appliance.api.audit_trail import client_address
from appliance.console.errors import ConsoleError
from appliance.console.forms import read_form
from appliance.console.routes import Services, Viewer, record_admin_action, render
from audit.errors import AuditError, ExportRangeError
from audit.export import ExportRequest, ExportSummary, export_bundle, resolve_range
from audit.log import AuditLog

router = APIRouter(prefix="/console", include_in_schema=False)

MAX_EXPORT_ENTRIES = 50_000
FIELDS = ("first_index", "last_index", "since", "until")


@router.get("/export")
async def export_page(services: Services, session: Viewer) -> Response:
    store = services.trail.log.store
    try:
        size = await asyncio.to_thread(store.size)
        checkpoint = await asyncio.to_thread(store.latest_checkpoint)
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    return render(
        services, session, "audit", "audit_export.html",
        size=size, checkpoint=checkpoint, origin=services.trail.log.origin,
        vkey=services.trail.log.vkey, max_entries=MAX_EXPORT_ENTRIES,
    )  # fmt: skip


@router.post("/export")
async def export(request: Request, services: Services, session: Viewer) -> Response:
    wanted = parse_export_form(await read_form(request))
    log = services.trail.log
    await asyncio.to_thread(_check_size, log, wanted)
    await record_admin_action(request, services, session, "audit.export", wanted.to_details())
    folder = Path(tempfile.mkdtemp(prefix="inferno-export-"))
    try:
        summary = await asyncio.to_thread(
            export_bundle, log, folder / "bundle.tar", wanted,
            actor=session.principal.actor(), source_address=client_address(request.scope),
            as_tar=True,
        )  # fmt: skip
    except ExportRangeError as exc:  # the log changed since the range was checked
        shutil.rmtree(folder, ignore_errors=True)
        raise ConsoleError(400, str(exc)) from None
    except AuditError:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConsoleError(503, "the audit log could not export now; try again") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return FileResponse(
        summary.path,
        media_type="application/x-tar",
        filename=bundle_name(log.origin, summary),
        headers=services.pages.headers,
        background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True),
    )


def parse_export_form(form: Mapping[str, str]) -> ExportRequest:
    """The export the form asks for: positions (`first_index`, `last_index`) or times (`since`,
    `until`, `YYYY-MM-DDTHH:MM` in UTC); every field empty means the whole log. Raises
    ConsoleError (400) saying which field is wrong."""
    values = {name: form.get(name, "").strip() for name in FIELDS}
    indices = {}
    for name in ("first_index", "last_index"):
        if values[name] and not values[name].isdigit():
            shown = values[name][:20]
            raise ConsoleError(400, f"{name} must be an entry number (0 or more), not {shown!r}")
        indices[name] = int(values[name]) if values[name] else None
    times = {}
    for name in ("since", "until"):
        try:
            moment = datetime.fromisoformat(values[name]) if values[name] else None
        except ValueError:
            raise ConsoleError(400, f"{name} must be a time like 2026-11-25T14:30 (UTC)") from None
        if moment is not None and moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        times[name] = moment
    if times["since"] and times["until"] and times["since"] > times["until"]:
        raise ConsoleError(400, "since must not come after until")
    try:
        return ExportRequest(**indices, **times)
    except ExportRangeError as exc:
        raise ConsoleError(400, str(exc)) from None


def _check_size(log: AuditLog, wanted: ExportRequest) -> None:
    """Refuse a range outside the log or over MAX_EXPORT_ENTRIES, before anything is recorded."""
    try:
        first, last = resolve_range(log, wanted)
        end = log.store.size() if last is None else last + 1
    except ExportRangeError as exc:
        raise ConsoleError(400, str(exc)) from None
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    if end - first > MAX_EXPORT_ENTRIES:
        raise ConsoleError(
            400,
            f"that range holds {end - first} entries; the console exports at most "
            f"{MAX_EXPORT_ENTRIES} at a time: narrow it, or run inferno audit export on the "
            "appliance",
        )


def bundle_name(origin: str, summary: ExportSummary) -> str:
    """`audit-<origin's host part>-<first>-<last>.tar`, only characters safe in a file name."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in origin.split("/")[0])
    last = summary.first_index + summary.num_entries - 1
    return f"audit-{host}-{summary.first_index}-{last}.tar"
