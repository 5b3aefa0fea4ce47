"""Export a range of the log as a bundle that auditors verify offline (see audit.bundle).

The export is itself an audit event: it is appended (with who asked and for what range) and a
checkpoint is signed before the bundle is written, so an open-ended export ends with its own
record. Every exported entry is covered by a signed checkpoint: the bundle runs to the first
checkpoint at or after the requested last entry, so it may hold a few entries more than asked.
Checkpoints are exported as stored, with the cosignatures of the log's witnesses (if any).
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from audit.bundle import CHECKPOINTS, ENTRIES, MANIFEST, VERIFY_DOC, Manifest, checkpoint_name
from audit.canonical import JsonValue
from audit.errors import AuditError, ExportRangeError
from audit.event import SYSTEM, Action, Actor, AuditEvent, Outcome, format_time
from audit.log import AuditLog
from audit.store import StoredCheckpoint


@dataclass(frozen=True)
class ExportSummary:
    path: Path
    first_index: int
    num_entries: int
    checkpoint_sizes: list[int]
    export_entry: int


@dataclass(frozen=True)
class ExportRequest:
    """Which entries: an index range, a time range, or (neither) the whole log.

    Indices are inclusive; `last_index` None means up to the export's own entry.
    """

    first_index: int | None = None
    last_index: int | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        by_index = self.first_index is not None or self.last_index is not None
        if by_index and (self.since is not None or self.until is not None):
            raise ExportRangeError("export by index range or by time range, not both")
        if (self.first_index or 0) < 0:
            raise ExportRangeError("the first index cannot be negative")
        if self.last_index is not None and self.last_index < (self.first_index or 0):
            raise ExportRangeError("the last index comes before the first")

    def to_details(self) -> dict[str, JsonValue]:
        return {
            "first_index": self.first_index,
            "last_index": self.last_index,
            "since": None if self.since is None else format_time(self.since),
            "until": None if self.until is None else format_time(self.until),
        }


def export_bundle(
    log: AuditLog,
    out: Path,
    request: ExportRequest,
    *,
    actor: Actor = SYSTEM,
    source_address: str | None = None,
    request_id: str | None = None,
    as_tar: bool = False,
) -> ExportSummary:
    """Write the bundle for `request` to `out` (a new directory, or a tar file with `as_tar`).

    Appends an `audit.export` event first: if that fails, nothing is exported.
    """
    if out.exists():
        raise ExportRangeError(f"{out} already exists; choose a new path")
    first, last = resolve_range(log, request)
    receipt = log.append(
        AuditEvent(
            Action.AUDIT_EXPORT,
            Outcome.SUCCESS,
            datetime.now(UTC),
            actor,
            source_address,
            request_id,
            {"request": request.to_details(), "first_index": first},
        )
    )
    signed = log.checkpoint()
    if signed is not None:
        # The bundle carries the cosignatures the witnesses give its newest checkpoint: wait for
        # them (bounded); a witness that does not answer is missing from the bundle, which an
        # auditor requiring it then refuses.
        log.wait_for_witnesses(signed.size)
    last = receipt.index if last is None else last
    covering = log.store.checkpoints(last + 1, log.store.size())
    if not covering:
        raise AuditError(f"no signed checkpoint covers entry {last}; retry the export")
    end = covering[0].size
    stored = log.store.checkpoints(max(first, 1), end)
    manifest = Manifest(
        origin=log.origin,
        first_index=first,
        num_entries=end - first,
        prefix=log.store.frontier(first),
        checkpoint_sizes=[c.size for c in stored],
        exported_at=format_time(datetime.now(UTC)),
        export_entry=receipt.index,
    )
    if as_tar:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            _write_directory(log, Path(tmp) / "bundle", manifest, stored)
            with tarfile.open(out, "w") as tar:
                for path in sorted((Path(tmp) / "bundle").rglob("*")):
                    tar.add(path, arcname=path.relative_to(Path(tmp) / "bundle"), recursive=False)
    else:
        try:
            _write_directory(log, out, manifest, stored)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
    return ExportSummary(out, first, end - first, manifest.checkpoint_sizes, receipt.index)


def resolve_range(log: AuditLog, request: ExportRequest) -> tuple[int, int | None]:
    """The first index and the last one (None: up to the export's own entry) of `request`, as
    `export_bundle` resolves it; callers check a range's size with it before exporting. Raises
    ExportRangeError for a range outside the log."""
    size = log.store.size()
    if request.since is None and request.until is None:
        first = request.first_index or 0
        if first > size:
            raise ExportRangeError(f"the log has {size} entries; it has no entry {first}")
        if request.last_index is not None and request.last_index >= size:
            raise ExportRangeError(
                f"the log has {size} entries; it has no entry {request.last_index}"
            )
        return first, request.last_index
    found = log.store.index_range(request.since, request.until)
    if found is None:
        raise ExportRangeError("no entries were logged in that time range")
    return found[0], (None if request.until is None else found[1])


def _write_directory(
    log: AuditLog, out: Path, manifest: Manifest, stored: Sequence[StoredCheckpoint]
) -> None:
    (out / CHECKPOINTS).mkdir(parents=True)
    last = manifest.first_index + manifest.num_entries - 1
    with (out / ENTRIES).open("wb") as f:
        for _, data in log.store.entries(manifest.first_index, last):
            f.write(data + b"\n")
    for checkpoint in stored:
        (out / checkpoint_name(checkpoint.size)).write_text(checkpoint.note, encoding="utf-8")
    (out / MANIFEST).write_bytes(manifest.to_json())
    (out / VERIFY_DOC).write_text(_verify_doc(manifest), encoding="utf-8")


def _verify_doc(manifest: Manifest) -> str:
    last = manifest.first_index + manifest.num_entries - 1
    return f"""# Verifying this audit export

Log `{manifest.origin}`, entries {manifest.first_index} to {last}, exported {manifest.exported_at}.

1. Obtain the log's verifier key (vkey) **out of band**, from the appliance's administrators
   (`inferno audit vkey` on the appliance). Do not take it from this bundle or from whoever
   handed it to you: the vkey is what makes the check meaningful. It should read
   `{manifest.origin}+<8 hex digits>+<base64>`.
2. With Python 3.11+ and the `cryptography` package, and Inferno's `audit` package, run

       python -m audit verify THIS_BUNDLE --vkey 'VKEY' --state audit-state.json

   It exits 0 only if every check passes: every checkpoint's signature against the pinned key,
   every entry's position, the recomputed Merkle root at every checkpoint, no two roots for
   one size, no checkpoint beyond the entries present, and (with `--state`) that this log
   extends the one you verified last time. If the log has witnesses, pin their keys (obtained
   from their operators) with `--witness 'WITNESS_VKEY'` and require K of them with
   `--min-witnesses K`: their cosignatures rule out a history shown to you alone. Keep the
   state file between exports: it is how a rewritten or truncated history is caught. Export
   from the last size you verified (`--from` that size) so the bundles overlap.

Files: `entries.jsonl` (one RFC 8785 canonical JSON entry per line, exactly the bytes hashed:
leaf hash = SHA-256(0x00 || line)), `checkpoints/<size>.txt` (C2SP tlog-checkpoints, Ed25519
signed notes), `manifest.json` (the range and the hashes of the entries before it; unsigned,
checked against the signed roots).
"""
