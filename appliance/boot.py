"""The fail-closed start-up sequence (ARCHITECTURE.md, "Start-up"), as far as it exists so far:

1. The settings are loaded and validated before anything starts (appliance.config).
2. The audit log opens and records `boot.start` (software version, config digest), here. If
   either fails, the appliance exits without serving.
3. The model loads and its weights are digested; `boot.ready` records them, and only then is
   inference served (appliance.app). A failed load is recorded as a failed `boot.phase`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from datetime import UTC, datetime

from sqlalchemy.engine import make_url

from appliance.config import AuditSettings, Settings
from appliance.errors import BootError
from audit.canonical import canonicalize
from audit.errors import AuditError
from audit.event import Action, AuditEvent, Outcome, system_event
from audit.log import AuditLog, AuditLogSettings
from audit.policy import CheckpointPolicy


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


def boot_ready(*, model: str, weights_digest: str, model_load_ms: float | None) -> AuditEvent:
    """Step 3's record: the model served from now on; `model_load_ms` is None for a model
    loaded before the app was built (the demo, tests)."""
    return system_event(
        Action.BOOT_READY,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS,
        details={
            "model": model,
            "weights_digest": weights_digest,
            "model_load_ms": None if model_load_ms is None else round(model_load_ms, 3),
        },
    )


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
