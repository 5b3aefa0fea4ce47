"""A scripted TEE for tests of the service and the boot gate: a collector whose next
collections succeed or fail as a test says, and a verifier that passes or fails them with the
checks a test names. The end-to-end tests (tests/e2e/test_boot_gate.py) use the real
collection and verifiers over synthetic devices instead."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from appliance.attestation.evidence import TeeEvidence
from attestation.binding import NO_CHANNEL, Channel
from attestation.errors import CollectionError
from attestation.verdict import Check, Verdict


@dataclass(frozen=True)
class FakeReport:
    """Stands for a GPU's or the CPU's evidence: JSON-serializable, like the real ones."""

    kind: str
    bound_to: bytes
    uuid: str | None = None  # a GPU's, as NVML names it

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "bound_to": self.bound_to.hex(), "uuid": self.uuid}


@dataclass
class FakeCollector:
    """Collects fake evidence for the challenge it is given; `fail_with` makes collections
    raise CollectionError with that message."""

    fail_with: str | None = None
    gpu_uuids: tuple[str, ...] = ("GPU-00000000-fake",)
    num_collections: int = 0
    num_gpus_ready: int = 0

    def collect(
        self, challenge: bytes, public_key: bytes, channel: Channel = NO_CHANNEL
    ) -> TeeEvidence:
        self.num_collections += 1
        if self.fail_with is not None:
            raise CollectionError(self.fail_with)
        gpu = tuple(FakeReport("gpu", challenge, uuid) for uuid in self.gpu_uuids)
        digest = hashlib.sha256(challenge).digest()
        bound = hashlib.sha512(challenge + digest + public_key).digest()
        cpu = FakeReport("cpu", bound)
        return TeeEvidence(challenge, public_key, gpu, cpu, digest, bound, channel)  # type: ignore[arg-type]

    def set_gpus_ready(self) -> None:
        self.num_gpus_ready += 1


@dataclass
class FakeVerifier:
    """Passes every evidence with one check, unless `failures` names checks to fail (with their
    reasons); `verdicts` records every verdict given."""

    failures: dict[str, str] = field(default_factory=dict)
    raises: Exception | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    on_verify: Callable[[TeeEvidence], None] | None = None
    claims: dict[str, Any] = field(default_factory=lambda: {"gpu": {"driver_version": "550.90.07"}})

    def verify(self, evidence: TeeEvidence, *, at: datetime) -> Verdict:
        if self.on_verify is not None:
            self.on_verify(evidence)
        if self.raises is not None:
            raise self.raises
        checks = [Check("gpu0.signature", True)]
        checks += [Check(name, False, detail) for name, detail in self.failures.items()]
        verdict = Verdict(tuple(checks), at, self.claims)
        self.verdicts.append(verdict)
        return verdict
