"""`GET /v1/audit/proof/<index>`: a c2sp.org/tlog-proof that entry `index` is in the audit log,
so that a client can keep an offline receipt for the entry its `Audit-Entry` header named
(`python -m audit verify-proof PROOF --vkey VKEY --leaf-hash HASH`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from appliance.api.audit_trail import Trail
from appliance.api.schemas import ErrorResponse

router = APIRouter()


@router.get(
    "/v1/audit/proof/{index}",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {}}, "description": "the tlog-proof"},
        404: {"model": ErrorResponse, "description": "the log has no entry at that index"},
        503: {"model": ErrorResponse, "description": "the audit log cannot be read"},
    },
)
async def audit_proof(index: int, trail: Trail) -> PlainTextResponse:
    # Reads the database, and may wait for a checkpoint to be signed: not on the event loop.
    proof = await asyncio.to_thread(trail.log.proof, index)
    return PlainTextResponse(proof)
