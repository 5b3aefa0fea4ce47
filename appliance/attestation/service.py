"""The TEE service: runs attestations, holds the standing verdict, and signs verdicts.

The standing state is what every response's `X-Inferno-TEE` header, `/health` and the boot
gate read:

    PENDING     tee.mode = required, no attestation finished yet
    VERIFIED    the last attestation passed (and none failed since boot)
    FAILED      an attestation failed; sticky until restart (fail closed: after a failure the
                appliance does not come back by itself, since what failed may still be wrong
                in a way the next check does not see)
    UNVERIFIED  tee.mode = insecure-dev: nothing is attested

Each attestation has an id (`Attestation.id`); the standing one's id and age are what every
response's `X-Inferno-Attestation` header and every inference audit entry name.

Everything that can go wrong in an attestation becomes a failed check of its verdict, never an
exception that could be mistaken for "no answer yet": a collection that fails (CC off, no
configfs-tsm), a policy that cannot be read, a verifier that crashes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from appliance.attestation.challenge import new_challenge
from appliance.attestation.evidence import EvidenceCollector, EvidenceVerifier, TeeEvidence
from appliance.attestation.signing import STATEMENT_TYPE, AttestationKey
from appliance.config import TeeMode
from attestation.binding import NO_CHANNEL, Channel
from attestation.errors import AttestationError, CollectionError
from attestation.verdict import Check, Verdict

logger = logging.getLogger(__name__)

TeeState = Literal["PENDING", "VERIFIED", "FAILED", "UNVERIFIED"]


class AttestationBusyError(Exception):
    """A client asked for an attestation while one is being collected: the devices answer one
    at a time, and clients must not be able to queue up work without bound."""


Trigger = Literal["boot", "reattest", "client"]
_VERDICT_ID_CONTEXT = b"inferno.attestation.verdict-id.v1\x00"


@dataclass(frozen=True, slots=True)
class Attestation:
    """One attestation: its challenge, the evidence (None if it could not be collected), and
    the verdict."""

    trigger: Trigger
    challenge: bytes
    evidence: TeeEvidence | None
    verdict: Verdict

    @property
    def id(self) -> str:
        """32 hex digits naming this attestation: derived from its challenge, which is fresh
        for each one (the appliance's own are drawn from the CSPRNG), so that the audit entry of
        the verdict, the `X-Inferno-Attestation` header and the inference entries that ran
        under it name it alike."""
        return hashlib.sha256(_VERDICT_ID_CONTEXT + self.challenge).hexdigest()[:32]

    def summary(self) -> str:
        """The failed checks in one line, for /health and the server log (names and the
        verifiers' reasons; never raw evidence)."""
        if self.verdict.trusted:
            return "attestation passed"
        failures = self.verdict.failures or (Check("attestation", False, "no check ran"),)
        return "; ".join(f"{c.name}: {c.detail}" if c.detail else c.name for c in failures)


class TeeService:
    """Runs attestations through `collector` and `verifier`, one at a time."""

    def __init__(
        self,
        mode: TeeMode,
        collector: EvidenceCollector | None,
        verifier: EvidenceVerifier | None,
        *,
        key: AttestationKey | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if mode == "required" and (collector is None or verifier is None):
            raise ValueError('tee.mode = "required" needs an evidence collector and a verifier')
        self.mode = mode
        self.collector = collector
        self.verifier = verifier
        self.key = key or AttestationKey.generate()
        self.clock = clock
        self._standing: Attestation | None = None
        self._failed = False
        # What the evidence binds besides the challenge and the key: the serving TLS key and
        # the audit vkey (bind_channel, at start-up). Until then, nothing: a client that checks
        # the channel refuses such evidence.
        self.channel: Channel = NO_CHANNEL
        self._lock = asyncio.Lock()
        # Set when a client's attestation failed: the re-attestation timer runs at once.
        self.reattest_requested = asyncio.Event()
        # When the re-attestation timer (appliance.boot.startup) runs next, unless asked
        # sooner; None while it is not waiting (before the boot verdict, during a
        # re-attestation, after a failure stopped it).
        self.next_reattestation: datetime | None = None

    def state(self) -> TeeState:
        if self.mode == "insecure-dev":
            return "UNVERIFIED"
        if self._failed:
            return "FAILED"
        return "VERIFIED" if self._standing is not None else "PENDING"

    @property
    def standing(self) -> Attestation | None:
        """The last boot or re-attestation (None before the first, and in insecure-dev)."""
        return self._standing

    def bind_channel(self, channel: Channel) -> None:
        """Bind every later attestation's evidence to `channel` (start-up step 3, once the TLS
        certificate the server serves is known)."""
        self.channel = channel

    def verdict_in_force(self) -> str | None:
        """The id of the standing verdict (None before the first, and in insecure-dev)."""
        return None if self._standing is None else self._standing.id

    def attestation_header(self) -> str:
        """`X-Inferno-Attestation`: `id=<verdict id>; age=<whole seconds since its validation
        time>` of the standing verdict; `UNVERIFIED` in insecure-dev, `PENDING` before the
        first verdict."""
        if self.mode == "insecure-dev":
            return "UNVERIFIED"
        standing = self._standing
        if standing is None:
            return "PENDING"
        age_s = max(0, int((self.clock() - standing.verdict.at).total_seconds()))
        return f"id={standing.id}; age={age_s}"

    async def attest(self, trigger: Literal["boot", "reattest"]) -> Attestation:
        """Attest for a fresh challenge and make the result the standing verdict. A failure
        makes the state FAILED for good."""
        attestation = await self._run(trigger, new_challenge())
        self._standing = attestation
        if not attestation.verdict.trusted:
            self._failed = True
        return attestation

    async def attest_for_client(self, challenge: bytes) -> Attestation:
        """Attest for a client's challenge. The standing verdict is left as it is (a client
        chooses when this runs, and must not be able to stop inference with it), but a failure
        asks for a re-attestation now (`reattest_requested`) rather than at the next interval:
        what the client saw fail, the appliance checks for itself at once, and stops inference
        if it fails again. Raises AttestationBusyError at once if a collection is running."""
        if self._lock.locked():
            raise AttestationBusyError("an attestation is being collected; retry shortly")
        attestation = await self._run("client", challenge)
        if not attestation.verdict.trusted and self.state() == "VERIFIED":
            logger.warning(
                "a client's attestation failed (%s); re-attesting now", attestation.summary()
            )
            self.reattest_requested.set()
        return attestation

    async def _run(self, trigger: Trigger, challenge: bytes) -> Attestation:
        if self.mode != "required":
            raise RuntimeError("nothing is attested in insecure-dev mode")
        async with self._lock:  # one collection at a time: the devices serialize it anyway
            return await asyncio.to_thread(self._attest, trigger, challenge)

    def _attest(self, trigger: Trigger, challenge: bytes) -> Attestation:
        assert self.collector is not None and self.verifier is not None, "checked in __init__"
        at, channel = self.clock(), self.channel
        try:
            evidence = self.collector.collect(challenge, self.key.public_bytes, channel)
        except CollectionError as exc:
            return self._failed_attestation(trigger, challenge, at, "collect", str(exc))
        except Exception as exc:
            logger.exception("collecting TEE evidence failed unexpectedly")
            return self._failed_attestation(
                trigger, challenge, at, "collect", f"{type(exc).__name__}; see the server log"
            )
        if (evidence.challenge, evidence.public_key, evidence.channel) != (
            challenge,
            self.key.public_bytes,
            channel,
        ):
            return self._failed_attestation(
                trigger,
                challenge,
                at,
                "collect",
                "the evidence answers another challenge, key or channel",
            )
        try:
            verdict = self.verifier.verify(evidence, at=at)
        except AttestationError as exc:
            verdict = Verdict((Check("verify", False, str(exc)),), at)
        except Exception as exc:
            logger.exception("verifying TEE evidence failed unexpectedly")
            verdict = Verdict(
                (Check("verify", False, f"{type(exc).__name__}; see the server log"),), at
            )
        return Attestation(trigger, challenge, evidence, verdict)

    @staticmethod
    def _failed_attestation(
        trigger: Trigger, challenge: bytes, at: datetime, step: str, detail: str
    ) -> Attestation:
        return Attestation(trigger, challenge, None, Verdict((Check(step, False, detail),), at))

    async def set_gpus_ready(self) -> None:
        """Start-up step 4, once the boot verdict passed: let the GPUs accept work. Raises
        CollectionError."""
        assert self.collector is not None, "only in required mode"
        if self.state() != "VERIFIED":
            raise RuntimeError("the GPUs are set ready only after a passing verdict")
        await asyncio.to_thread(self.collector.set_gpus_ready)

    def signed_statement(self, attestation: Attestation) -> dict[str, Any]:
        """The appliance's signed verdict on `attestation` (appliance.attestation.signing): the
        challenge, the evidence digest, the verdict and the standing TEE state."""
        evidence = attestation.evidence
        statement = {
            "type": STATEMENT_TYPE,
            "challenge": attestation.challenge.hex(),
            "attestation_public_key": self.key.public_bytes.hex(),
            "evidence_digest": None if evidence is None else evidence.digest(),
            "report_data": None if evidence is None else evidence.report_data.hex(),
            "tls_spki_sha256": _hex(self.channel.tls_spki_sha256),
            "audit_vkey": self.channel.audit_vkey,
            "verdict_id": attestation.id,
            "verdict": attestation.verdict.to_json(),
            "tee": self.state(),
        }
        return self.key.sign(statement)


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()
