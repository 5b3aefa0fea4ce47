"""The attestation's records in the console (admins and auditors): the standing attestation's
evidence as a download, and the history of verdicts from the audit log, newest first, paged.

The evidence is what `GET /v1/attestation` answers as `evidence`: its `gpu` member is the file
`python -m attestation verify-gpu --evidence` takes, its `cpu` member the one `verify-cpu
--evidence` takes, so an auditor checks the appliance's verdict offline with their own policy.
Its SHA-256 over RFC 8785 canonical JSON is the `evidence_digest` the verdict's audit entry
names. A download is an export: it is audited as `admin.attestation.evidence_export` first.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from appliance.attestation.signing import json_safe
from appliance.console.audit_search import AuditQuery, search
from appliance.console.errors import ConsoleError
from appliance.console.forms import read_form
from appliance.console.routes import Services, Viewer, record_admin_action, render
from audit.errors import AuditError
from audit.event import Action

router = APIRouter(prefix="/console", include_in_schema=False)

HISTORY_PAGE_SIZE = 25
# What a download holds: the whole evidence, or the part one offline verifier takes.
EVIDENCE_PARTS = ("all", "gpu", "cpu")


@router.get("/attestation/history")
async def history(request: Request, services: Services, session: Viewer) -> Response:
    before_text = request.query_params.get("before")
    before = None
    if before_text is not None:
        if not before_text.isdigit() or int(before_text) < 1:
            raise ConsoleError(
                400, "before must be a positive entry number (the “Older verdicts” link sets it)"
            )
        before = int(before_text)
    query = AuditQuery(action=Action.ATTESTATION_VERDICT)
    try:
        found = await asyncio.to_thread(search, services.trail.log.store, query, before,
                                        page_size=HISTORY_PAGE_SIZE)  # fmt: skip
    except AuditError:
        raise ConsoleError(503, "the audit log cannot be read now; try again") from None
    return render(
        services, session, "attestation", "attestation_history.html",
        found=found, before=before, page_size=HISTORY_PAGE_SIZE,
    )  # fmt: skip


@router.post("/attestation/evidence")
async def evidence(request: Request, services: Services, session: Viewer) -> Response:
    part = (await read_form(request)).get("part", "all")
    if part not in EVIDENCE_PARTS:
        raise ConsoleError(400, f"part must be one of {', '.join(EVIDENCE_PARTS)}")
    tee = services.tee
    if tee.mode != "required":
        raise ConsoleError(
            409, 'nothing is attested in tee.mode = "insecure-dev", so there is no evidence'
        )
    standing = tee.standing
    if standing is None:
        raise ConsoleError(
            409, "no attestation has finished yet; the first runs as the appliance starts"
        )
    if standing.evidence is None:
        raise ConsoleError(
            409, "the last attestation collected no evidence: its failed collect check says why"
        )
    digest = standing.evidence.digest()
    target = {"evidence_digest": digest, "part": part, "at": standing.verdict.at.isoformat()}
    await record_admin_action(request, services, session, "attestation.evidence_export", target)
    whole = json_safe(standing.evidence.to_json())
    body = whole if part == "all" else whole[part]
    name = f"evidence-{digest.removeprefix('sha256:')[:16]}-{part}.json"
    headers = {**services.pages.headers, "Content-Disposition": f'attachment; filename="{name}"'}
    return Response(json.dumps(body, indent=2, sort_keys=True) + "\n",
                    media_type="application/json", headers=headers)  # fmt: skip
