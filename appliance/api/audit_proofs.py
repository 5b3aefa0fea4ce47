"""`GET /v1/audit/proof/<index>`: a c2sp.org/tlog-proof that entry `index` is in the audit log,
so that a client can keep an offline receipt for the entry its `Audit-Entry` header named
(`python -m audit verify-proof PROOF --vkey VKEY --leaf-hash HASH`)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.responses import PlainTextResponse

from appliance.api.audit_trail import Trail

router = APIRouter()


def _error(description: str) -> dict[str, Any]:
    """An error answer, documented as sent: JSON. (A `model` would be documented in the route's
    own media type, text/plain.)"""
    schema = {"$ref": "#/components/schemas/ErrorResponse"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


@router.get(
    "/v1/audit/proof/{index}",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {}}, "description": "the tlog-proof"},
        400: _error("the index is not a whole number of at least 0"),
        404: _error("the log has no entry at that index"),
        503: _error("the audit log cannot be read"),
    },
)
async def audit_proof(index: Annotated[int, Path(ge=0)], trail: Trail) -> PlainTextResponse:
    # Reads the database, and may wait for a checkpoint to be signed: not on the event loop.
    proof = await asyncio.to_thread(trail.log.proof, index)
    return PlainTextResponse(proof)
