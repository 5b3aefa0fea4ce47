"""What one attestation collects, and the seams it is collected and verified through.

`TeeEvidence` is the evidence of one challenge: every GPU's report (for the nonces derived from
the challenge), the CPU report whose report_data binds the challenge, the GPU evidence digest,
the appliance's attestation public key and its channel (the serving TLS key, the audit log's
vkey: `attestation.binding.report_data_v2`), and those values themselves.

The seams are Protocols, so that a test can put synthetic devices (a test CA shaped like
NVIDIA's, a synthetic SEV-SNP chain) where NVML and configfs-tsm sit on a real machine, while
the collection logic, the binding and the verifiers stay the real ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from attestation.binding import NO_CHANNEL, Channel
from audit.canonical import canonicalize

if TYPE_CHECKING:
    from attestation.cpu.evidence import CpuEvidence
    from attestation.gpu.evidence import GpuEvidence
    from attestation.verdict import Verdict


@dataclass(frozen=True, slots=True)
class TeeEvidence:
    """The evidence of one challenge. `report_data` and `gpu_evidence_digest` are what the
    collector bound into the CPU report; a verifier recomputes both and never trusts these."""

    challenge: bytes
    public_key: bytes
    gpu: tuple[GpuEvidence, ...]
    cpu: CpuEvidence
    gpu_evidence_digest: bytes
    report_data: bytes
    channel: Channel = NO_CHANNEL

    def to_json(self) -> dict[str, Any]:
        """The evidence as `/v1/attestation` returns it: the GPU list in the format of
        `python -m attestation verify-gpu --evidence`, the CPU report in its own format."""
        return {
            "challenge": self.challenge.hex(),
            "attestation_public_key": self.public_key.hex(),
            "gpu": [item.to_json() for item in self.gpu],
            "cpu": self.cpu.to_json(),
            "gpu_evidence_digest": self.gpu_evidence_digest.hex(),
            "report_data": self.report_data.hex(),
            "binding": "v2",
            "tls_spki_sha256": _hex(self.channel.tls_spki_sha256),
            "audit_vkey": self.channel.audit_vkey,
        }

    def digest(self) -> str:
        """`sha256:` of the RFC 8785 canonical JSON of `to_json()`: what the audit log and the
        signed verdict name instead of the raw evidence."""
        return "sha256:" + hashlib.sha256(canonicalize(self.to_json())).hexdigest()


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


class GpuEvidenceSource(Protocol):
    """The GPUs of this machine (NVML on a real one)."""

    def num_gpus(self) -> int:
        """How many GPUs there are to attest. Raises CollectionError if that cannot be told."""
        ...

    def collect(self, nonces: Sequence[bytes]) -> Sequence[GpuEvidence]:
        """One report per GPU, GPU `i` signing `nonces[i]`. Raises CollectionError (CC off, no
        driver, a timeout) saying which GPU and why."""
        ...

    def set_ready(self) -> None:
        """Let the GPUs accept work (start-up step 4; in CC mode they refuse it until then).
        Called only after a passing, recorded verdict. Raises CollectionError."""
        ...


class CpuEvidenceSource(Protocol):
    """The confidential VM's CPU report (configfs-tsm on a real machine)."""

    def collect(self, report_data: bytes) -> CpuEvidence:
        """A report binding the 64 bytes `report_data`. Raises CollectionError saying why none
        could be had."""
        ...


class EvidenceCollector(Protocol):
    def collect(self, challenge: bytes, public_key: bytes, channel: Channel) -> TeeEvidence:
        """The evidence for `challenge`, bound to `public_key` and `channel`. Raises
        CollectionError."""
        ...

    def set_gpus_ready(self) -> None:
        """GpuEvidenceSource.set_ready of the GPUs it collects from."""
        ...


class EvidenceVerifier(Protocol):
    def verify(self, evidence: TeeEvidence, *, at: datetime) -> Verdict:
        """Every check of `evidence` at the validation time `at`, as one Verdict. Raises
        AttestationError only where no verdict can be formed (a policy that cannot be read);
        the caller turns that into a failed check."""
        ...
