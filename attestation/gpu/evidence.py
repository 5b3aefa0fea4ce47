"""GPU evidence as it travels: the JSON exchange format of ARCHITECTURE.md (NVIDIA's de-facto
format, a list of `{"arch", "nonce" (hex), "evidence" (base64 report), "certificate" (base64 PEM
chain)}`), plus two optional keys Inferno adds when it collected the evidence itself through NVML:
`"cc_mode"` ("on" | "off" | "devtools") and `"dev_tools_mode"` (bool). These two are read from the
driver, not signed by the GPU; policy treats their absence as unknown, never as "on"/"off".

NVIDIA's protected-PCIe (PPCIe) tools add three informative keys per GPU: `"driver_version"`,
`"vbios_version"` and `"version"` (the entry's format version, "1.0"). They are kept (so the
JSON round-trips and the digest covers them) but never trusted: verification compares each
declared version with the one the GPU signed (`gpuN.declared.*`). Any other key is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509

from attestation.gpu.chain import load_certificates
from attestation.gpu.errors import GpuEvidenceFormatError
from attestation.input_limits import MAX_GPU_EVIDENCE_BYTES, parse_json

CC_MODES = ("on", "off", "devtools")
EVIDENCE_FORMAT_VERSIONS = ("1.0",)
_REQUIRED_KEYS = {"arch", "nonce", "evidence", "certificate"}
_KEYS = _REQUIRED_KEYS | {
    "cc_mode", "dev_tools_mode", "driver_version", "vbios_version", "version", "uuid"
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    """One GPU's evidence: `report` (the raw SPDM request ‖ response), `certificate_chain` (the
    PEM chain as the device gave it, leaf first), the nonce the collector asked for, the NVML
    state when known, and the informative versions of the PPCIe shape when given (unverified
    declarations: `verify_gpu_evidence` compares them with the signed report). Construct
    through `from_json` or the collector: fields are decoded."""

    arch: str
    nonce: bytes
    report: bytes
    certificate_chain: bytes
    cc_mode: str | None = None
    dev_tools_mode: bool | None = None
    driver_version: str | None = None
    vbios_version: str | None = None
    format_version: str | None = None
    # NVML's UUID of the GPU that gave this evidence (`GPU-` and 36 hex digits and dashes): a
    # declaration of the collector, not signed by the GPU, but covered by the evidence digest
    # that the CPU report binds, so it is what the attested VM's own code saw. The appliance
    # matches it against the devices its engine uses (appliance.boot.gpu_coverage).
    uuid: str | None = None

    def certificates(self) -> tuple[x509.Certificate, ...]:
        """The chain parsed, leaf first. Raises GpuEvidenceFormatError."""
        return tuple(
            load_certificates(self.certificate_chain, pem=True, error=GpuEvidenceFormatError)
        )

    def to_json(self) -> dict[str, Any]:
        item: dict[str, Any] = {
            "arch": self.arch,
            "nonce": self.nonce.hex(),
            "evidence": base64.b64encode(self.report).decode("ascii"),
            "certificate": base64.b64encode(self.certificate_chain).decode("ascii"),
        }
        if self.cc_mode is not None:
            item["cc_mode"] = self.cc_mode
        if self.dev_tools_mode is not None:
            item["dev_tools_mode"] = self.dev_tools_mode
        for key, value in (
            ("driver_version", self.driver_version),
            ("vbios_version", self.vbios_version),
            ("version", self.format_version),
            ("uuid", self.uuid),
        ):
            if value is not None:
                item[key] = value
        return item

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> GpuEvidence:
        """One entry of the exchange format. Raises GpuEvidenceFormatError on a missing or
        unknown key, bad hex or base64, a chain that is not PEM, an informative version that is
        not a non-empty string, or a format version other than EVIDENCE_FORMAT_VERSIONS."""
        if not isinstance(item, Mapping):
            raise GpuEvidenceFormatError("a GPU evidence entry must be a JSON object")
        unknown = set(item) - _KEYS
        missing = _REQUIRED_KEYS - set(item)
        if unknown or missing:
            raise GpuEvidenceFormatError(
                f"GPU evidence entry: missing keys {sorted(missing)}, "
                f"unknown keys {sorted(unknown)}"
            )
        if not isinstance(item["arch"], str) or not item["arch"]:
            raise GpuEvidenceFormatError("arch must be a non-empty string")
        cc_mode, dev_tools = item.get("cc_mode"), item.get("dev_tools_mode")
        if cc_mode is not None and cc_mode not in CC_MODES:
            raise GpuEvidenceFormatError(f"cc_mode {cc_mode!r} is not one of {CC_MODES}")
        if dev_tools is not None and not isinstance(dev_tools, bool):
            raise GpuEvidenceFormatError("dev_tools_mode must be true or false")
        format_version = _optional_text(item, "version")
        if format_version is not None and format_version not in EVIDENCE_FORMAT_VERSIONS:
            raise GpuEvidenceFormatError(
                f"evidence format version {format_version!r} is not one of "
                f"{EVIDENCE_FORMAT_VERSIONS}"
            )
        evidence = cls(
            arch=item["arch"],
            nonce=_hex(item["nonce"], "nonce"),
            report=_base64(item["evidence"], "evidence"),
            certificate_chain=_base64(item["certificate"], "certificate"),
            cc_mode=cc_mode,
            dev_tools_mode=dev_tools,
            driver_version=_optional_text(item, "driver_version"),
            vbios_version=_optional_text(item, "vbios_version"),
            format_version=format_version,
            uuid=_optional_text(item, "uuid"),
        )
        evidence.certificates()
        return evidence


def evidence_list_from_json(data: bytes | str) -> list[GpuEvidence]:
    """The exchange format's JSON text, a non-empty list of entries, within the limits of
    attestation.input_limits (MAX_GPU_EVIDENCE_BYTES, MAX_NESTING_DEPTH). Raises
    GpuEvidenceFormatError."""
    items = parse_json(
        data,
        what="the GPU evidence",
        error=GpuEvidenceFormatError,
        max_bytes=MAX_GPU_EVIDENCE_BYTES,
    )
    if not isinstance(items, list) or not items:
        raise GpuEvidenceFormatError("evidence must be a non-empty JSON list, one entry per GPU")
    return [GpuEvidence.from_json(item) for item in items]


def evidence_list_to_json(evidence: Sequence[GpuEvidence]) -> str:
    return json.dumps([item.to_json() for item in evidence], indent=2)


def gpu_evidence_digest(evidence: Sequence[GpuEvidence]) -> bytes:
    """SHA-256 of the canonical bytes of the evidence list: the UTF-8 JSON of `to_json()` of each
    entry in order, keys sorted, no whitespace (`json.dumps(..., sort_keys=True,
    separators=(",", ":"))`). This is what the CPU report binds (attestation.binding)."""
    canonical = json.dumps(
        [item.to_json() for item in evidence], sort_keys=True, separators=(",", ":")
    ).encode("utf-8")
    return hashlib.sha256(canonical).digest()


def _optional_text(item: Mapping[str, Any], key: str) -> str | None:
    value = item.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise GpuEvidenceFormatError(f"{key} must be a non-empty string")
    return value


def _hex(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise GpuEvidenceFormatError(f"{what} must be a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise GpuEvidenceFormatError(f"{what} is not hex") from exc


def _base64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise GpuEvidenceFormatError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise GpuEvidenceFormatError(f"{what} is not base64") from exc
