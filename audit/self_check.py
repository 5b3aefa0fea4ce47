"""Verification of the log by the appliance itself, recorded in the log (an admin action).

It runs exactly what an auditor runs: export everything, then the offline verifier with the log's
own vkey. The outcome is appended as an `audit.verify` event, pass or fail.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path

from audit.canonical import JsonValue
from audit.errors import BundleFormatError, VerificationError
from audit.event import SYSTEM, Action, Actor, AuditEvent, Outcome
from audit.export import ExportRequest, export_bundle
from audit.log import AuditLog
from audit.note import VerifierKey
from audit.verify import VerificationReport, verify_bundle


def verify_log(
    log: AuditLog,
    *,
    actor: Actor = SYSTEM,
    source_address: str | None = None,
    request_id: str | None = None,
) -> VerificationReport:
    """Verify the whole log as an auditor would; raises VerificationError on failure.

    Both outcomes are appended as `audit.verify` events.
    """

    def record(outcome: Outcome, details: dict[str, JsonValue]) -> None:
        log.append(
            AuditEvent(
                Action.AUDIT_VERIFY,
                outcome,
                datetime.now(UTC),
                actor,
                source_address,
                request_id,
                details,
            )
        )

    with tempfile.TemporaryDirectory() as tmp:
        summary = export_bundle(
            log,
            Path(tmp) / "bundle",
            ExportRequest(),
            actor=actor,
            source_address=source_address,
            request_id=request_id,
        )
        try:
            report = verify_bundle(summary.path, VerifierKey.parse(log.vkey))
        except (VerificationError, BundleFormatError) as exc:
            record(Outcome.FAILURE, {"error": str(exc)})
            raise VerificationError(str(exc)) from exc
    record(
        Outcome.SUCCESS,
        {"num_entries": report.num_entries, "tree_size": report.new_state.size},
    )
    return report
