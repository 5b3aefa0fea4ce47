"""The fail-closed start-up sequence (ARCHITECTURE.md, "Start-up"):

1. The settings are loaded and validated before anything starts (appliance.config); the
   production profile refuses insecure settings there.
2. The audit log opens and records `boot.start` (software version, config digest), here. If
   either fails, the appliance exits without serving.
3. The TEE gate (`pass_tee_gate`): with `tee.mode = required`, evidence is collected for a fresh
   challenge and verified offline; the verdict is recorded (`attestation.verdict`). A failing
   verdict, or one the log cannot record, ends the sequence here: no key, no weights, no
   inference; `/health` says why. With `insecure-dev` the gate is skipped, and the log records
   that nothing was attested.
4. After a pass, the GPUs are set ready (NVML's CC "GPUs ready" state), or the gate stays shut.
5-6. Only after a pass (or in insecure-dev): the model's key is released to the verdict and the
   weights load (`load_model`); `boot.ready` records them, and only then is inference served
   (appliance.app). A failed load is recorded as a failed `boot.phase`.
8. Re-attestation on a timer (`reattest_periodically`); a failure is recorded and stops
   inference.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from sqlalchemy.engine import make_url

from appliance.attestation.service import Attestation, TeeService, TeeState
from appliance.attestation.signing import json_safe
from appliance.config import AuditSettings, Settings
from appliance.errors import BootError
from attestation.errors import CollectionError
from audit.canonical import canonicalize
from audit.errors import AuditError
from audit.event import Action, AuditEvent, Outcome, system_event
from audit.log import AuditLog, AuditLogSettings
from audit.policy import CheckpointPolicy

logger = logging.getLogger(__name__)


def audit_log_settings(audit: AuditSettings) -> AuditLogSettings:
    return AuditLogSettings(
        origin=audit.origin,
        database_url=audit.effective_database_url,
        key_dir=audit.effective_key_dir,
        policy=CheckpointPolicy(
            every_entries=audit.checkpoint_every_entries,
            every_s=audit.checkpoint_every_s,
            heartbeat_s=audit.heartbeat_s,
        ),
        commitment_key_file=audit.commitment_key_file,
    )


def open_audit_log(audit: AuditSettings) -> AuditLog:
    """Open the audit log these settings name (the server's, or `inferno audit`'s). Raises
    BootError saying why it cannot be opened."""
    try:
        audit.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return AuditLog.open(audit_log_settings(audit))
    except (AuditError, OSError) as exc:
        raise BootError(
            f"the audit log cannot be opened (audit.database_url = "
            f"{_shown_url(audit.effective_database_url)}, audit.key_dir = "
            f"{audit.effective_key_dir}): {exc}"
        ) from exc


def start_audit_log(settings: Settings) -> AuditLog:
    """Step 2: open the audit log and record `boot.start`. Raises BootError if either fails:
    the appliance must not serve without its log."""
    log = open_audit_log(settings.audit)
    try:
        log.append(
            system_event(
                Action.BOOT_START,
                time=datetime.now(UTC),
                outcome=Outcome.SUCCESS,
                details={
                    "software_version": importlib.metadata.version("inferno"),
                    "config_digest": config_digest(settings),
                },
            )
        )
    except AuditError as exc:
        log.close()
        raise BootError(f"the audit log cannot record boot.start: {exc}") from exc
    return log


def boot_ready(
    *,
    model: str,
    weights_digest: str,
    model_load_ms: float | None,
    tee: TeeState,
    attestation_ms: float | None = None,
) -> AuditEvent:
    """Step 7's record: the model served from now on, the TEE state it is served in, and the
    time of each phase: `attestation_ms` (collection, verification and recording; None when
    nothing was attested) and `model_load_ms` (key release, decryption and load; None for a
    model loaded before the app was built: the demo, tests)."""
    return system_event(
        Action.BOOT_READY,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS,
        details={
            "model": model,
            "weights_digest": weights_digest,
            "model_load_ms": None if model_load_ms is None else round(model_load_ms, 3),
            "attestation_ms": None if attestation_ms is None else round(attestation_ms, 3),
            "tee": tee,
        },
    )


def attestation_verdict(attestation: Attestation, tee: TeeState) -> AuditEvent:
    """The record of a boot or re-attestation: the result, every failed check with its reason,
    the claims established (versions, measurements, TCB), and digests in place of the evidence
    itself (raw evidence is never logged)."""
    verdict, evidence = attestation.verdict, attestation.evidence
    return system_event(
        Action.ATTESTATION_VERDICT,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS if verdict.trusted else Outcome.FAILURE,
        details=json_safe(
            {
                "trigger": attestation.trigger,
                "mode": "required",
                "tee": tee,
                "result": "trusted" if verdict.trusted else "not trusted",
                "at": verdict.at.isoformat().replace("+00:00", "Z"),
                "challenge": attestation.challenge.hex(),
                "evidence_digest": None if evidence is None else evidence.digest(),
                "attestation_public_key": None if evidence is None else evidence.public_key.hex(),
                "num_checks": len(verdict.checks),
                "failed": [check.to_json() for check in verdict.failures],
                "claims": dict(verdict.claims),
            }
        ),
    )


def attestation_skipped() -> AuditEvent:
    """The record that `tee.mode = insecure-dev` skipped the gate: a failure, since nothing
    about the machine was verified, though the appliance serves."""
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


class TeeGateError(BootError):
    """The TEE gate did not pass: no key is released, no weight loaded."""


async def pass_tee_gate(tee: TeeService, log: AuditLog) -> Attestation | None:
    """Step 3. Attest (in `required` mode) and record the verdict; return the passing
    attestation, or None in insecure-dev. Raises TeeGateError saying why the gate is closed: a
    failing verdict (its failed checks), or a verdict the audit log cannot record (an
    unrecorded pass is no pass)."""
    if tee.mode == "insecure-dev":
        logger.warning("tee.mode = insecure-dev: the TEE is not attested; serving UNVERIFIED")
        try:
            await log.append_async(attestation_skipped())
        except AuditError as exc:
            raise TeeGateError(
                f"the audit log cannot record the skipped attestation: {exc}"
            ) from exc
        return None
    attestation = await tee.attest("boot")
    try:
        await log.append_async(attestation_verdict(attestation, tee.state()))
    except AuditError as exc:
        raise TeeGateError(f"the audit log cannot record the attestation verdict: {exc}") from exc
    if not attestation.verdict.trusted:
        raise TeeGateError(f"attestation failed: {attestation.summary()}")
    try:
        await tee.set_gpus_ready()  # step 4
    except CollectionError as exc:
        raise TeeGateError(
            f"the GPUs could not be set ready after a passing verdict: {exc}"
        ) from exc
    return attestation


async def reattest_periodically(
    tee: TeeService,
    log: AuditLog,
    interval_s: float,
    on_failure: Callable[[str], Awaitable[None]],
) -> None:
    """Step 8: every `interval_s`, or at once when a client's attestation failed
    (`tee.reattest_requested`), attest again and record the verdict. On the first failure (or a
    verdict the log cannot record, or anything unexpected: a timer that dies silently would be
    a gate left open) await `on_failure(reason)` and return: inference stays stopped until
    restart. Runs until cancelled."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tee.reattest_requested.wait(), timeout=interval_s)
        tee.reattest_requested.clear()
        try:
            reason = await _reattest_once(tee, log)
        except Exception as exc:
            logger.exception("re-attestation failed unexpectedly")
            reason = f"re-attestation failed ({type(exc).__name__}); see the server log"
        if reason is not None:
            logger.error("%s; inference stops", reason)
            await on_failure(reason)
            return


async def _reattest_once(tee: TeeService, log: AuditLog) -> str | None:
    """One re-attestation, recorded; the reason to stop inference, or None."""
    attestation = await tee.attest("reattest")
    reason = None
    if not attestation.verdict.trusted:
        reason = f"re-attestation failed: {attestation.summary()}"
    try:
        await log.append_async(attestation_verdict(attestation, tee.state()))
    except AuditError as exc:
        reason = reason or f"the audit log cannot record a re-attestation verdict: {exc}"
    return reason


def boot_phase_failed(phase: str, exc: BaseException) -> AuditEvent:
    """A start-up phase that failed, with the error's class (its message is in the server log
    and on /health)."""
    return system_event(
        Action.BOOT_PHASE,
        time=datetime.now(UTC),
        outcome=Outcome.FAILURE,
        details={"phase": phase, "error": type(exc).__name__},
    )


def config_digest(settings: Settings) -> str:
    """`sha256:` of the effective settings as RFC 8785 canonical JSON, so that an auditor can
    tell which boots ran with the same configuration. The database password is hidden first:
    the digest must not let anyone who reads the log test guesses of it."""
    values = settings.model_dump(mode="json")
    values["audit"]["database_url"] = _shown_url(settings.audit.effective_database_url)
    return "sha256:" + hashlib.sha256(canonicalize(values)).hexdigest()


def _shown_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
