"""CPU TEE evidence as collected from configfs-tsm, and its JSON form.

The JSON form is what `/v1/attestation` returns and `python -m attestation verify-cpu` reads:
`{"kind": "snp" | "tdx", "report": base64, "auxblob": base64 | null, "provider": str}`.
`report` is the SEV-SNP ATTESTATION_REPORT or the TDX quote; `auxblob` is what the provider
attached (for SEV-SNP, the extended-report certificate table holding VCEK, ASK and ARK).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from attestation.errors import EvidenceError

CpuKind = Literal["snp", "tdx"]
CPU_KINDS: tuple[CpuKind, ...] = ("snp", "tdx")

# configfs-tsm `provider` values (Documentation/ABI/testing/configfs-tsm).
PROVIDER_KINDS: Mapping[str, CpuKind] = {"sev_guest": "snp", "tdx_guest": "tdx"}


@dataclass(frozen=True, slots=True)
class CpuEvidence:
    """One CPU report or quote as collected; unverified. `provider` is configfs-tsm's name of
    the driver that produced it (`sev_guest`, `tdx_guest`), informative only."""

    kind: CpuKind
    report: bytes
    auxblob: bytes | None = None
    provider: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CPU_KINDS:
            raise EvidenceError(f"CPU evidence kind must be one of {CPU_KINDS}, got {self.kind!r}")
        if not self.report:
            raise EvidenceError("CPU evidence has an empty report")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "report": base64.b64encode(self.report).decode("ascii"),
            "auxblob": (
                None if self.auxblob is None else base64.b64encode(self.auxblob).decode("ascii")
            ),
            "provider": self.provider,
        }

    @classmethod
    def from_json(cls, value: Any) -> CpuEvidence:
        """Parse the JSON form. Raises EvidenceError on a missing field, an unknown kind or
        bad base64; unknown fields are refused too, so a typo cannot pass silently."""
        if not isinstance(value, Mapping):
            raise EvidenceError("CPU evidence must be a JSON object")
        unknown = set(value) - {"kind", "report", "auxblob", "provider"}
        if unknown:
            raise EvidenceError(f"CPU evidence has unknown fields: {sorted(unknown)}")
        kind = value.get("kind")
        if kind not in CPU_KINDS:
            raise EvidenceError(f"CPU evidence kind must be one of {CPU_KINDS}, got {kind!r}")
        provider = value.get("provider", "")
        if not isinstance(provider, str):
            raise EvidenceError("CPU evidence provider must be a string")
        auxblob = value.get("auxblob")
        return cls(
            kind=kind,
            report=_b64(value.get("report"), "report"),
            auxblob=None if auxblob is None else _b64(auxblob, "auxblob"),
            provider=provider,
        )


def _b64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise EvidenceError(f"CPU evidence {name} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise EvidenceError(f"CPU evidence {name} is not valid base64: {exc}") from exc
