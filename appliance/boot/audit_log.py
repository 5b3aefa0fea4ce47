"""The audit log that the settings name, opened for the server's start-up (step 2 of
`appliance.boot.startup`) and for the commands that read or append to it (`inferno audit`,
`inferno token`). Light to import: these commands answer without loading torch."""

from __future__ import annotations

from appliance.config import AuditSettings
from appliance.errors import BootError
from audit.errors import AuditError
from audit.log import AuditLog, AuditLogSettings
from audit.policy import CheckpointPolicy


def open_audit_log(audit: AuditSettings) -> AuditLog:
    """The audit log these settings name (the server's, or `inferno audit`'s). Raises
    BootError saying why it cannot be opened."""
    try:
        audit.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return AuditLog.open(audit_log_settings(audit))
    except (AuditError, OSError) as exc:
        raise BootError(
            f"the audit log cannot be opened (audit.database_url = "
            f"{audit.redacted_database_url}, audit.key_dir = {audit.effective_key_dir}): {exc}"
        ) from exc


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
        witnesses=tuple(w.endpoint for w in audit.witnesses),
        witness_timeout_s=audit.witness_timeout_s,
    )
