"""The appliance's attestation key and the verdicts it signs for clients.

The key is an Ed25519 key made at each boot and held in memory only. Its public key is bound
into every CPU report the appliance requests (`attestation.binding.report_data_v2(challenge,
gpu_evidence_digest, public_key, channel)`), so a client that verified the CPU report for its
own nonce knows the key belongs to that TEE, and can then trust what it signs: the appliance's
verdict on the same evidence. A per-boot key needs no storage and no rotation; a client learns
it from each fresh report.

A signed verdict is `{"statement": {...}, "signature": base64}`; the signature is Ed25519 over
`SIGNING_CONTEXT ‖ RFC 8785 canonical JSON of the statement`, so that it can never be taken for
a signature of anything else. `verify_signed_verdict` is the client's check of the signature
alone; the CPU report, the binding and the GPU evidence are verified with `python -m
attestation` (docs/ATTESTATION.md, "Verifying the appliance").
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from audit.canonical import MAX_SAFE_INTEGER, canonicalize

SIGNING_CONTEXT = b"inferno.attestation.signed-verdict.v1\x00"
STATEMENT_TYPE = "inferno.attestation.verdict.v1"


class SignedVerdictError(ValueError):
    """A signed verdict that is malformed or whose signature does not verify."""


@dataclass(frozen=True, slots=True)
class AttestationKey:
    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> AttestationKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_bytes(self) -> bytes:
        """The raw 32-byte public key: what report_data binds."""
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, statement: Mapping[str, Any]) -> dict[str, Any]:
        """`statement` signed; it must name this key in `attestation_public_key` (hex)."""
        if statement.get("attestation_public_key") != self.public_bytes.hex():
            raise ValueError("a signed statement must name the key that signs it")
        statement = json_safe(dict(statement))
        signature = self.private_key.sign(SIGNING_CONTEXT + canonicalize(statement))
        return {"statement": statement, "signature": base64.b64encode(signature).decode()}


def json_safe(value: Any) -> Any:
    """`value` with every integer beyond I-JSON's exact range (RFC 7493 §2.2: a TCB version,
    a u64 field of a report) written as its decimal string, so that it canonicalizes (RFC 8785)
    and reads back the same in every JSON parser."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) <= MAX_SAFE_INTEGER else str(value)
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def verify_signed_verdict(signed: Mapping[str, Any]) -> Mapping[str, Any]:
    """The statement of `signed`, once its signature verifies under the public key the statement
    names. Raises SignedVerdictError. That key must still be checked against the CPU report's
    report_data; this proves only that its holder signed the statement."""
    statement, signature = signed.get("statement"), signed.get("signature")
    if not isinstance(statement, Mapping) or not isinstance(signature, str):
        raise SignedVerdictError("a signed verdict has a statement object and a signature string")
    if statement.get("type") != STATEMENT_TYPE:
        raise SignedVerdictError(f"the statement is not of type {STATEMENT_TYPE}")
    try:
        key = Ed25519PublicKey.from_public_bytes(
            bytes.fromhex(str(statement.get("attestation_public_key")))
        )
        raw_signature = base64.b64decode(signature, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise SignedVerdictError(f"the key or the signature is malformed: {exc}") from exc
    try:
        key.verify(raw_signature, SIGNING_CONTEXT + canonicalize(dict(statement)))
    except InvalidSignature:
        raise SignedVerdictError("the signature does not verify under the named key") from None
    return statement
