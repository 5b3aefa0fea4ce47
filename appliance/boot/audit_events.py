"""What start-up records in the audit log (docs/AUDIT.md, "Actions"): one builder per event of
`appliance.boot.startup`, so that a reviewer sees every detail an entry carries in one place.

Raw evidence, keys and error messages never go into an entry: evidence is named by its digest,
a failure by its error class (its message goes to the server log and /health).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Mapping
from datetime import UTC, datetime

from appliance.attestation.service import Attestation, TeeState
from appliance.attestation.signing import json_safe
from appliance.config import Settings
from audit.canonical import canonicalize
from audit.event import Action, AuditEvent, Outcome, system_event


def boot_start(settings: Settings) -> AuditEvent:
    """Step 2's record: the software that starts and the settings it starts with."""
    return system_event(
        Action.BOOT_START,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS,
        details={
            "software_version": importlib.metadata.version("inferno"),
            "config_digest": config_digest(settings),
        },
    )


def attestation_verdict(attestation: Attestation, tee: TeeState) -> AuditEvent:
    """Steps 3 and 8's record: the result, every failed check with its reason, the claims
    established (versions, measurements, TCB), and digests in place of the evidence itself."""
    verdict, evidence = attestation.verdict, attestation.evidence
    spki = None if evidence is None else evidence.channel.tls_spki_sha256
    return system_event(
        Action.ATTESTATION_VERDICT,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS if verdict.trusted else Outcome.FAILURE,
        details=json_safe(
            {
                "trigger": attestation.trigger,
                "verdict_id": attestation.id,
                "mode": "required",
                "tee": tee,
                "result": "trusted" if verdict.trusted else "not trusted",
                "at": verdict.at.isoformat().replace("+00:00", "Z"),
                "challenge": attestation.challenge.hex(),
                "evidence_digest": None if evidence is None else evidence.digest(),
                "attestation_public_key": None if evidence is None else evidence.public_key.hex(),
                "tls_spki_sha256": None if spki is None else spki.hex(),
                "num_checks": len(verdict.checks),
                "failed": [check.to_json() for check in verdict.failures],
                "claims": dict(verdict.claims),
            }
        ),
    )


def attestation_skipped() -> AuditEvent:
    """Step 3's record under `tee.mode = insecure-dev`: a failure, since nothing about the
    machine was verified, though the appliance serves."""
    return system_event(
        Action.ATTESTATION_VERDICT,
        time=datetime.now(UTC),
        outcome=Outcome.FAILURE,
        details={
            "trigger": "boot",
            "mode": "insecure-dev",
            "tee": "UNVERIFIED",
            "result": "skipped",
            "reason": "tee.mode = insecure-dev: nothing about this machine was attested",
        },
    )


def boot_phase_failed(phase: str, exc: BaseException) -> AuditEvent:
    """A step that failed (`key_release`, `model_load`), with the error's class."""
    return system_event(
        Action.BOOT_PHASE,
        time=datetime.now(UTC),
        outcome=Outcome.FAILURE,
        details={"phase": phase, "error": type(exc).__name__},
    )


def engine_stopped(exc: BaseException) -> AuditEvent:
    """The engine stopped on an error while serving (a tensor-parallel worker died, a GPU
    fault): nothing is served until restart. The error's class, not its message."""
    return system_event(
        Action.ENGINE_STOPPED,
        time=datetime.now(UTC),
        outcome=Outcome.FAILURE,
        details={"error": type(exc).__name__},
    )


def boot_ready(
    *,
    model: str,
    weights_digest: str,
    model_load_ms: float | None,
    tee: TeeState,
    attestation_ms: float | None = None,
    load_phases_ms: Mapping[str, float] | None = None,
) -> AuditEvent:
    """Step 7's record: the model served from now on, the TEE state it is served in, and the
    time of each phase: `attestation_ms` (collection, verification and recording; None when
    nothing was attested), `model_load_ms` (key release, decryption, load and warm-up; None
    for a model loaded before the app was built: the demo, tests) and `load_phases_ms`, its
    parts (LoadedModel.phases_ms: key_release_ms, torch_wait_ms and preload_wait_ms when the
    engine was preloaded, weights_ms, engine_build_ms)."""
    return system_event(
        Action.BOOT_READY,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS,
        details={
            "model": model,
            "weights_digest": weights_digest,
            "model_load_ms": None if model_load_ms is None else round(model_load_ms, 3),
            "attestation_ms": None if attestation_ms is None else round(attestation_ms, 3),
            "load_phases_ms": None if load_phases_ms is None else dict(load_phases_ms),
            "tee": tee,
        },
    )


def config_digest(settings: Settings) -> str:
    """`sha256:` of the effective settings as RFC 8785 canonical JSON, so that an auditor can
    tell which boots ran with the same configuration. The database password is hidden first:
    the digest must not let anyone who reads the log test guesses of it."""
    values = settings.model_dump(mode="json")
    values["audit"]["database_url"] = settings.audit.redacted_database_url
    return "sha256:" + hashlib.sha256(canonicalize(values)).hexdigest()
