"""The answer of `GET /v1/attestation`, parsed once at the boundary into frozen values
(docs/ATTESTATION.md, "GET /v1/attestation"). Nothing downstream reads the raw JSON.

The whole answer is bounded by MAX_ATTESTATION_RESPONSE_BYTES (the GPU and CPU evidence limits
of attestation.input_limits plus 1 MiB for the verdicts) and MAX_NESTING_DEPTH before it is
parsed. Every malformed field is an EvidenceError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from attestation.binding import NONCE_SIZE, SPKI_SHA256_SIZE, BindingError, Channel
from attestation.cpu.evidence import CpuEvidence
from attestation.errors import EvidenceError
from attestation.gpu.evidence import GpuEvidence
from attestation.input_limits import MAX_CPU_EVIDENCE_BYTES, MAX_GPU_EVIDENCE_BYTES, parse_json

MAX_ATTESTATION_RESPONSE_BYTES = MAX_GPU_EVIDENCE_BYTES + MAX_CPU_EVIDENCE_BYTES + (1 << 20)
ATTESTATION_PUBLIC_KEY_SIZE = 32  # raw Ed25519
MAX_NUM_GPUS = 64


@dataclass(frozen=True, slots=True)
class ApplianceEvidence:
    """The `evidence` member: what the appliance collected for the client's nonce. `binding`
    names the report_data domain ("v2"; evidence of v1 binds no channel)."""

    challenge: bytes
    attestation_public_key: bytes
    gpu: tuple[GpuEvidence, ...]
    cpu: CpuEvidence
    binding: str
    channel: Channel

    @classmethod
    def from_json(cls, value: Any) -> ApplianceEvidence:
        item = _object(value, "evidence")
        gpu = item.get("gpu")
        if not isinstance(gpu, list) or not 0 < len(gpu) <= MAX_NUM_GPUS:
            raise EvidenceError(f"evidence.gpu must be a list of 1 to {MAX_NUM_GPUS} entries")
        binding = item.get("binding", "v1")
        if binding not in ("v1", "v2"):
            raise EvidenceError("evidence.binding must be v1 or v2")
        try:
            channel = Channel(
                _optional_hex(item.get("tls_spki_sha256"), "evidence.tls_spki_sha256"),
                _optional_text(item.get("audit_vkey"), "evidence.audit_vkey"),
            )
        except BindingError as exc:
            raise EvidenceError(f"evidence: {exc}") from exc
        return cls(
            challenge=_hex(item.get("challenge"), "evidence.challenge", NONCE_SIZE),
            attestation_public_key=_hex(
                item.get("attestation_public_key"),
                "evidence.attestation_public_key",
                ATTESTATION_PUBLIC_KEY_SIZE,
            ),
            gpu=tuple(GpuEvidence.from_json(entry) for entry in gpu),
            cpu=CpuEvidence.from_json(item.get("cpu")),
            binding=binding,
            channel=channel,
        )


@dataclass(frozen=True, slots=True)
class AttestationDocument:
    """The whole answer: the appliance's TEE state, the nonce it answered, its evidence (None
    when it could collect none), its own verdict's result on that evidence (informative: the
    client verifies for itself) and the validation time of its standing verdict."""

    tee: str
    nonce: bytes
    evidence: ApplianceEvidence | None
    appliance_result: str
    standing_at: datetime | None

    @classmethod
    def parse(cls, data: bytes) -> AttestationDocument:
        """Raises EvidenceError for an answer over the limits, not JSON, or malformed."""
        item = _object(
            parse_json(
                data,
                what="the /v1/attestation answer",
                error=EvidenceError,
                max_bytes=MAX_ATTESTATION_RESPONSE_BYTES,
            ),
            "the /v1/attestation answer",
        )
        tee = item.get("tee")
        if tee not in ("PENDING", "VERIFIED", "FAILED", "UNVERIFIED"):
            raise EvidenceError("tee must be PENDING, VERIFIED, FAILED or UNVERIFIED")
        evidence = item.get("evidence")
        verdict = _object(item.get("verdict"), "verdict")
        standing = item.get("standing_verdict")
        return cls(
            tee=tee,
            nonce=_hex(item.get("nonce"), "nonce", NONCE_SIZE),
            evidence=None if evidence is None else ApplianceEvidence.from_json(evidence),
            appliance_result=str(verdict.get("result", ""))[:32],
            standing_at=None
            if standing is None
            else _time(_object(standing, "standing_verdict").get("at"), "standing_verdict.at"),
        )


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise EvidenceError(f"{what} must be a JSON object")
    return value


def _hex(value: Any, what: str, size: int) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * size:
        raise EvidenceError(f"{what} must be {size} bytes in hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise EvidenceError(f"{what} must be hexadecimal") from None


def _optional_hex(value: Any, what: str) -> bytes | None:
    return None if value is None else _hex(value, what, SPKI_SHA256_SIZE)


def _optional_text(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EvidenceError(f"{what} must be a string or null")
    return value


def _time(value: Any, what: str) -> datetime:
    if not isinstance(value, str) or len(value) > 64:
        raise EvidenceError(f"{what} must be an RFC 3339 time")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise EvidenceError(f"{what} must be an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise EvidenceError(f"{what} has no UTC offset")
    return moment.astimezone(UTC)
