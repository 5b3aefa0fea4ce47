"""The console's pages and admin actions.

Pages: Overview (admins), Attestation and Audit (admins and auditors), Access and System
(admins); who may open what is `appliance.api.access.ROUTE_ACCESS`. The Overview's live charts
poll `/console/overview/series` (JSON: the points of appliance.console.series after the last
one the page has, and the texts of appliance.console.charts). Every action that changes
something (re-attest, drain, revoking a session) is first appended to the audit log as
`admin.<operation>`, naming the admin; if that append fails, the action is refused and nothing
changes. Actions answer with a redirect to the page they came from (POST-redirect-GET).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from appliance.api.access import ADMIN, ROUTE_ACCESS, Console
from appliance.api.audit_trail import AuditTrail, client_address
from appliance.api.console_login import CurrentSession
from appliance.api.metrics import ServerMetrics
from appliance.api.readiness import Readiness
from appliance.attestation.service import TeeService
from appliance.auth.authenticator import Authenticator
from appliance.auth.denials import DenialReporter
from appliance.auth.local_issuer import LOCAL_ROLE_MAPPING, LocalIssuer
from appliance.auth.sessions import Session, SessionRecord, SessionStore, SessionStoreError
from appliance.config import Settings
from appliance.console import charts
from appliance.console.audit_search import AuditQuery, AuditQueryError, search
from appliance.console.errors import ConsoleError
from appliance.console.gpus import GpuRow, gpu_note, gpu_rows
from appliance.console.pages import ConsolePages
from appliance.console.series import SeriesSampler
from appliance.console.table import sort_and_page
from attestation.collateral import describe_age
from attestation.sealed.manifest import SealedManifest
from attestation.trust_bundle import parse_created
from audit.encoding import encode_base64
from audit.errors import AuditError, UnknownEntryError
from audit.event import Outcome, admin_action
from audit.merkle import hash_leaf

router = APIRouter(prefix="/console", include_in_schema=False)

# (page, path, label); a page is listed for the roles its route admits. The overview's route
# admits auditors too, only to send them on to their first page.
_NAV = (
    ("overview", "/console/", "Overview"),
    ("attestation", "/console/attestation", "Attestation"),
    ("audit", "/console/audit", "Audit"),
    ("usage", "/console/usage", "Usage"),
    ("access", "/console/access", "Access"),
    ("system", "/console/system", "System"),
)
_NAV_ROLES = {"overview": ADMIN}


@dataclass(frozen=True, slots=True)
class ConsoleServices:
    """What the console shows and acts on; built once by `appliance.app.build`."""

    pages: ConsolePages
    settings: Settings
    version: str
    sessions: SessionStore
    trail: AuditTrail
    tee: TeeService
    readiness: Readiness
    metrics: ServerMetrics
    authenticator: Authenticator
    sampler: SeriesSampler
    # The signed manifest of the sealed model served (None: plain weights, or not loaded yet).
    sealed_manifest: Callable[[], SealedManifest | None]
    # Refused sign-ins go to the audit log through the same per-address budget as refused
    # tokens.
    denials: DenialReporter[object]
    # The appliance's own token issuer, where `auth.local_issuer` enables it.
    local_issuer: LocalIssuer | None = None


async def _services(request: Request) -> ConsoleServices:
    return request.app.state.console


Services = Annotated[ConsoleServices, Depends(_services)]
Viewer = CurrentSession


def nav_for(session: Session) -> list[tuple[str, str, str]]:
    """The pages `session`'s roles may open, in menu order."""
    principal = session.principal
    visible = []
    for page, path, label in _NAV:
        rule = ROUTE_ACCESS[path]
        assert isinstance(rule, Console), "every console page is a Console route"
        if principal.has_any(_NAV_ROLES.get(page, rule.roles)):
            visible.append((page, path, label))
    return visible


def render(
    services: ConsoleServices, session: Session, page: str, template: str, **context: Any
) -> HTMLResponse:
    base = {
        "viewer": session.principal,
        "csrf_token": session.csrf_token,
        "nav": nav_for(session),
        "page": page,
        "tee_state": services.tee.state(),
    }
    return services.pages.render(template, {**base, **context})


async def record_admin_action(
    request: Request,
    services: ConsoleServices,
    session: Session,
    operation: str,
    target: Mapping[str, Any],
) -> None:
    """Append `admin.<operation>` naming `session`'s admin before the action runs; raises
    ConsoleError (503) if the log cannot store it, so that the action does not happen
    unrecorded."""
    event = admin_action(
        time=datetime.now(UTC),
        actor=session.principal.actor(),
        source_address=client_address(request.scope),
        request_id=None,
        operation=operation,
        outcome=Outcome.ACCEPTED,
        target=dict(target),
    )
    try:
        await services.trail.append(event)
    except AuditError:
        raise ConsoleError(
            503, "the audit log cannot record this action now, so it was not done; try again"
        ) from None


# -- pages ---------------------------------------------------------------------------------


@router.get("/")
async def overview(services: Services, session: Viewer) -> Response:
    if not session.principal.has_any(ADMIN):
        return RedirectResponse(nav_for(session)[0][1], status_code=303)
    status, reason = services.readiness.state()
    stats = services.metrics.engine_stats()
    sampler = services.sampler
    num_gpus = len(sampler.gpus.gpus)
    return render(
        services, session, "overview", "overview.html",
        mode=services.tee.mode,
        attestation=services.tee.standing,
        next_reattestation=services.tee.next_reattestation,
        reattest_interval_s=services.settings.tee.reattest_interval_s,
        model_name=services.trail.model_name,
        weights_digest=services.trail.weights_digest,
        sealed_manifest=services.sealed_manifest(),
        health=(status, reason),
        stats=stats,
        sealed_configured=services.settings.sealed.enabled,
        gpus=_gpu_rows(services),
        gpu_note=gpu_note(sampler.gpus, services.settings.engine.device),
        interval_s=sampler.interval_s,
        charts=charts.charts_for(num_gpus),
        summaries=charts.summaries(sampler.series.points(), num_gpus, sampler.interval_s),
        current=charts.current(sampler.series.latest(), stats),
    )  # fmt: skip


@router.get("/overview/series")
async def overview_series(request: Request, services: Services) -> Response:
    """The Overview's charts' data: with `series=ID&after=SEQ`, the points after that one;
    without them (or for another series than this server's, from before a restart) all, with
    `reset`. Built in a worker thread from a snapshot of the points: a whole hour of them (a
    page opening) takes tens of milliseconds that the event loop, serving the API, should not
    wait for."""
    sampler = services.sampler
    params = request.query_params
    after = params.get("after", "")
    after_seq = int(after) if after.isdigit() and len(after) < 19 else -1
    if params.get("series") != sampler.series.id:
        after_seq = -1
    standing = services.tee.standing
    body = await asyncio.to_thread(
        charts.series_json,
        sampler.series.points(),  # the snapshot: the sampler appends on the event loop
        series_id=sampler.series.id,
        after_seq=after_seq,
        interval_s=sampler.interval_s,
        window_s=sampler.series.window_s,
        gpus=sampler.gpus,
        claims=standing.verdict.claims if standing is not None else None,
        engine_device=services.settings.engine.device,
        stats=services.metrics.engine_stats(),
    )
    return Response(body, media_type="application/json", headers=services.pages.headers)


def _gpu_rows(services: ConsoleServices) -> list[GpuRow]:
    standing = services.tee.standing
    return gpu_rows(services.sampler.gpus, standing.verdict.claims if standing else None)


@router.get("/attestation")
async def attestation(request: Request, services: Services, session: Viewer) -> Response:
    standing = services.tee.standing
    checks = standing.verdict.checks if standing is not None else ()
    table = sort_and_page(
        checks,
        {"name": lambda c: c.name, "result": lambda c: c.passed},
        request.query_params,
        "name",
    )
    claims = None
    if standing is not None and standing.verdict.claims:
        claims = json.dumps(standing.verdict.claims, indent=2, sort_keys=True, default=str)
    history = await _newest(services, AuditQuery(action="attestation.verdict"), HISTORY_SIZE)
    return render(
        services, session, "attestation", "attestation.html",
        mode=services.tee.mode,
        attestation=standing,
        trust_bundle=_trust_bundle(standing.verdict.claims if standing else {}),
        table=table,
        claims=claims,
        history=history,
        can_reattest=session.principal.has_any(ADMIN),
        requested=request.query_params.get("requested") == "1",
    )  # fmt: skip


HISTORY_SIZE = 10


@dataclass(frozen=True)
class TrustBundleShown:
    digest: str
    created: datetime
    age: str


def _trust_bundle(claims: Mapping[str, Any]) -> TrustBundleShown | None:
    """The trust bundle the standing verdict's collateral came from (attestation.collateral's
    claims), with its age now; None where the collateral came from no bundle."""
    collateral = claims.get("collateral")
    named = collateral.get("trust_bundle") if isinstance(collateral, Mapping) else None
    if not isinstance(named, Mapping):
        return None
    created = parse_created(named.get("created"))
    age_s = max(0.0, (datetime.now(UTC) - created).total_seconds())
    return TrustBundleShown(str(named.get("digest")), created, describe_age(age_s))


async def _newest(services: ConsoleServices, query: AuditQuery, num: int) -> list[dict[str, Any]]:
    """The newest `num` entries matching `query`, from a scan of the usual bound."""
    try:
        found = await asyncio.to_thread(search, services.trail.log.store, query, None,
                                        page_size=num)  # fmt: skip
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    return found.entries


@router.get("/audit")
async def audit(request: Request, services: Services, session: Viewer) -> Response:
    params = request.query_params
    before_text = params.get("before", "")
    before = int(before_text) if before_text.isdigit() else None
    error = None
    try:
        query = AuditQuery.parse(params)
        found = await asyncio.to_thread(search, services.trail.log.store, query, before)
    except AuditQueryError as exc:
        found, error = None, str(exc)
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    form = {name: params.get(name, "") for name in
            ("since", "until", "principal", "action", "outcome", "request_id")}  # fmt: skip
    older = None
    if found is not None and found.next_before is not None:
        older = str(request.url.include_query_params(before=found.next_before).query)
    try:
        checkpoint = await asyncio.to_thread(services.trail.log.store.latest_checkpoint)
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    return render(
        services, session, "audit", "audit.html",
        form=form, outcomes=[str(o) for o in Outcome], page_of=found, error=error, older=older,
        origin=services.trail.log.origin, vkey=services.trail.log.vkey, checkpoint=checkpoint,
    )  # fmt: skip


CHECKPOINTS_PAGE_SIZE = 25


@router.get("/checkpoints")
async def checkpoints(request: Request, services: Services, session: Viewer) -> Response:
    """The log's signed checkpoints, largest first, paged by size (`below`)."""
    below_text = request.query_params.get("below")
    below = None
    if below_text is not None:
        if not below_text.isdigit() or int(below_text) < 1:
            raise ConsoleError(
                400, "below must be a positive tree size (the “Older checkpoints” link sets it)"
            )
        below = int(below_text)
    store = services.trail.log.store
    try:
        # One more than a page: whether an older page exists.
        found = await asyncio.to_thread(store.recent_checkpoints, below, CHECKPOINTS_PAGE_SIZE + 1)
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    page, more = found[:CHECKPOINTS_PAGE_SIZE], len(found) > CHECKPOINTS_PAGE_SIZE
    return render(
        services, session, "audit", "checkpoints.html",
        checkpoints=page, below=below, older=page[-1].size if more else None,
        origin=services.trail.log.origin, vkey=services.trail.log.vkey,
    )  # fmt: skip


@router.get("/audit/{index}")
async def audit_entry(
    index: str, request: Request, services: Services, session: Viewer
) -> Response:
    log = services.trail.log
    if not index.isdigit():
        raise ConsoleError(404, "an entry is named by its position, a number")
    position = int(index)
    try:
        data = await asyncio.to_thread(_entry_bytes, services, position)
        proof = await asyncio.to_thread(log.proof, position)
    except UnknownEntryError:
        raise ConsoleError(404, f"the log has no entry {position}") from None
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    download = request.query_params.get("download")
    if download in ("entry", "proof"):
        body = data + b"\n" if download == "entry" else proof.encode("utf-8")
        name = f"entry-{position}.json" if download == "entry" else f"proof-{position}.txt"
        headers = {**services.pages.headers,
                   "Content-Disposition": f'attachment; filename="{name}"'}  # fmt: skip
        return Response(body, media_type="text/plain; charset=utf-8", headers=headers)
    return render(
        services, session, "audit", "audit_entry.html",
        index=position,
        entry=json.dumps(json.loads(data), indent=2, sort_keys=True, ensure_ascii=False),
        leaf_hash=encode_base64(hash_leaf(data)),
        proof=proof,
        vkey=log.vkey,
    )  # fmt: skip


def _entry_bytes(services: ConsoleServices, index: int) -> bytes:
    store = services.trail.log.store
    if not 0 <= index < store.size():
        raise UnknownEntryError(f"the log has no entry at index {index}")
    return next(iter(store.entries(index, index)))[1]


@router.get("/access")
async def access(request: Request, services: Services, session: Viewer) -> Response:
    records = await asyncio.to_thread(services.sessions.list_live)
    table = sort_and_page(
        records,
        {
            "subject": lambda r: r.principal.subject,
            "roles": lambda r: " ".join(sorted(r.principal.roles)),
            "created": lambda r: r.created_at,
            "last_seen": lambda r: r.last_seen_at,
        },
        request.query_params,
        "last_seen",
        default_descending=True,
    )
    return render(
        services, session, "access", "access.html",
        table=table,
        expires_at=services.sessions.expires_at,
        own_handle=session.handle,
        auth=services.settings.auth,
        key_status={
            issuer: verifier.keys.status()
            for issuer, verifier in services.authenticator.verifiers.items()
        },
        role_mappings={i.issuer: i.role_mapping() for i in services.settings.auth.issuers},
        local_issuer=services.local_issuer,
        local_role_mapping=LOCAL_ROLE_MAPPING,
        revoked=request.query_params.get("revoked") == "1",
    )  # fmt: skip


@router.get("/system")
async def system(request: Request, services: Services, session: Viewer) -> Response:
    status, reason = services.readiness.state()
    return render(
        services, session, "system", "system.html",
        version=services.version,
        sections=redacted_settings(services.settings),
        health=(status, reason),
        audit_failure=services.trail.log.failure,
        drained=status == "draining",
    )  # fmt: skip


# -- admin actions -------------------------------------------------------------------------


@router.post("/attestation/reattest")
async def reattest(request: Request, services: Services, session: Viewer) -> Response:
    tee = services.tee
    if tee.mode != "required":
        raise ConsoleError(
            409, 'nothing is attested in tee.mode = "insecure-dev", so there is nothing to redo'
        )
    await record_admin_action(request, services, session, "tee.reattest", {"state": tee.state()})
    # The re-attestation timer (start-up step 8) runs at once, records the verdict, and stops
    # inference if it fails.
    tee.reattest_requested.set()
    return RedirectResponse("/console/attestation?requested=1", status_code=303)


@router.post("/system/drain")
async def drain(request: Request, services: Services, session: Viewer) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    if form.get("confirm") != ["drain"]:
        raise ConsoleError(
            400, "draining needs its confirmation: tick the box that says what it does"
        )
    await record_admin_action(request, services, session, "server.drain", {})
    services.readiness.drain(session.principal.subject)
    return RedirectResponse("/console/system", status_code=303)


@router.post("/access/sessions/{handle}/revoke")
async def revoke(handle: str, request: Request, services: Services, session: Viewer) -> Response:
    live = await asyncio.to_thread(services.sessions.list_live)
    record = next((r for r in live if r.handle == handle), None)
    if record is None:
        raise ConsoleError(404, "no such session: it may have ended already")
    target = _session_target(record)
    await record_admin_action(request, services, session, "session.revoke", target)
    try:
        await asyncio.to_thread(services.sessions.revoke, handle)
    except SessionStoreError:
        raise ConsoleError(503, "the session could not be revoked now; try again") from None
    return RedirectResponse("/console/access?revoked=1", status_code=303)


def _session_target(record: SessionRecord) -> dict[str, Any]:
    return {
        "session": record.handle[:16],
        "issuer": record.principal.issuer,
        "subject": record.principal.subject,
    }


@router.get("/static/{name}")
async def static(name: str, services: Services) -> Response:
    found = services.pages.static(name)
    if found is None:
        raise ConsoleError(404, "the console has no such file")
    body, media_type = found
    headers = {**services.pages.headers, "Cache-Control": "public, max-age=3600"}
    return Response(body, media_type=media_type, headers=headers)


# -- settings, redacted ----------------------------------------------------------------------

REDACTED = "(redacted)"
# Settings that name a secret or where one lies: the path tells an attacker where to look.
_SECRET_WORDS = ("secret", "password", "pin_file", "key_file")


def redacted_settings(settings: Settings) -> list[tuple[str, list[tuple[str, str]]]]:
    """Every setting as (section, [(name, shown value)]): the database URL without its
    password, anything naming a secret replaced, the rest as JSON."""
    sections = []
    for section, values in settings.model_dump(mode="json").items():
        rows = []
        for name, value in values.items():
            if section == "audit" and name == "database_url":
                value = settings.audit.redacted_database_url
            elif section == "auth" and name == "issuers":
                value = [_redacted(issuer) for issuer in value]
            rows.append((name, _shown(_redacted({name: value})[name])))
        sections.append((section, rows))
    return sections


def _redacted(values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: REDACTED if value is not None and any(w in name for w in _SECRET_WORDS) else value
        for name, value in values.items()
    }


def _shown(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, indent=2 if isinstance(value, list | dict) else None)


def install(app: FastAPI, services: ConsoleServices) -> None:
    """Serve the console from `app`: its routes, and its error page for what they refuse."""
    app.state.console = services

    async def on_refusal(request: Request, exc: ConsoleError) -> Response:
        return services.pages.error(exc.status, exc.message)

    app.add_exception_handler(ConsoleError, on_refusal)  # type: ignore[arg-type]
    app.include_router(router)
