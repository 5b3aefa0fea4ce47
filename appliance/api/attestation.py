"""`GET /v1/attestation?nonce=<64 hex digits>`: fresh evidence for the client's nonce and the
appliance's signed verdict on it, so that a client can verify the appliance itself
(docs/ATTESTATION.md, "Verifying the appliance").

The response holds the GPU evidence (in the format of `python -m attestation verify-gpu`) for
nonces derived from the client's (attestation.binding.gpu_nonces), the CPU report whose
report_data binds the nonce, the GPU evidence digest, the appliance's attestation public key
and its channel (the SHA-256 of the serving TLS certificate's SubjectPublicKeyInfo, and the
audit log's vkey: attestation.binding.report_data_v2); the verdict of the appliance's own
verifier on that evidence, with every failed check; the same verdict signed with the
attestation key; and the standing verdict (the boot's or the last re-attestation's) that gates
inference. A verdict that fails is still answered 200: the failed checks are the answer.
`python -m attestation verify-appliance` and `attestation.remote.AttestedTransport` are the
clients that check all of it against the connection they talk on.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from appliance.api.errors import APIError
from appliance.api.limits import Limits
from appliance.api.schemas import ErrorResponse
from appliance.attestation.challenge import parse_challenge
from appliance.attestation.service import AttestationBusyError, TeeService, TeeState
from appliance.attestation.signing import json_safe

router = APIRouter()


class AttestationResponse(BaseModel):
    tee: TeeState
    nonce: str
    # SHA-256 of the serving TLS certificate's SubjectPublicKeyInfo, as the evidence binds it
    # (null over plain HTTP): a client compares it with its own connection's peer.
    tls_spki_sha256: str | None
    evidence: dict[str, Any] | None
    verdict: dict[str, Any]
    signed_verdict: dict[str, Any]
    standing_verdict: dict[str, Any] | None


@router.get(
    "/v1/attestation",
    response_model=AttestationResponse,
    responses={
        400: {"model": ErrorResponse, "description": "the nonce is not 32 bytes in hex"},
        429: {
            "model": ErrorResponse,
            "description": "an attestation is being collected, or this address is over "
            "limits.attestation_requests_per_minute",
        },
        409: {"model": ErrorResponse, "description": "tee.mode = insecure-dev: nothing attested"},
    },
)
async def attestation(
    request: Request,
    nonce: Annotated[str, Query(description="32 random bytes, as 64 hex digits")],
    limits: Limits,
) -> JSONResponse:
    # Before anything else: each collection keeps the devices busy.
    await limits.admit_attestation(request)
    tee: TeeService = request.app.state.tee
    if tee.mode == "insecure-dev":
        # 409: the request is fine, the appliance's mode has nothing to answer it with.
        raise APIError(
            409,
            "this appliance runs with tee.mode = insecure-dev: its TEE is not attested and "
            "there is no evidence to show (X-Inferno-TEE: UNVERIFIED)",
            code="tee_unverified",
        )
    try:
        challenge = parse_challenge(nonce)
    except ValueError as exc:
        raise APIError(400, str(exc), param="nonce") from None
    try:
        fresh = await tee.attest_for_client(challenge)
    except AttestationBusyError as exc:
        raise APIError(
            429, str(exc), type="requests", code="attestation_busy", headers={"Retry-After": "1"}
        ) from None
    standing = tee.standing
    spki = None if fresh.evidence is None else fresh.evidence.channel.tls_spki_sha256
    body = AttestationResponse(
        tee=tee.state(),
        nonce=challenge.hex(),
        tls_spki_sha256=None if spki is None else spki.hex(),
        evidence=None if fresh.evidence is None else fresh.evidence.to_json(),
        verdict=fresh.verdict.to_json(),
        signed_verdict=tee.signed_statement(fresh),
        standing_verdict=None if standing is None else standing.verdict.to_json(),
    )
    return JSONResponse(json_safe(body.model_dump()))
