"""Offline verification of an export bundle against a pinned verifier key.

Needs only the standard library and `cryptography` (an import-linter contract and a test keep it
so). Trusts nothing in the bundle but what the pinned key signed, and, with a state file, what it
verified last time. Raises BundleFormatError when the input is unusable (exit 2) and
VerificationError naming the first failed check (exit 1).

The checks, in order:
  1. every file under checkpoints/ is a checkpoint of this log signed by the pinned key;
     no two of them (nor the state file) sign different roots for one tree size (equivocation);
     each is named for its size, and the manifest lists exactly these sizes;
  2. the state file's size lies within the bundle, so continuity can be checked;
  3. entry by entry: each line is canonical JSON naming its own position; the Merkle root,
     recomputed from the manifest's prefix hashes and the entries, equals the signed root at
     every checkpoint size and the state's root at its size (a rewritten history);
  4. no checkpoint signs more entries than the bundle holds (truncation), no entry lies beyond
     the last checkpoint (unsigned entries), and the manifest's count matches the file;
  5. with pinned witness keys: every cosignature by a pinned witness on any checkpoint verifies
     (c2sp.org/tlog-cosignature), and the newest checkpoint carries valid cosignatures from at
     least `min_witnesses` of them. The newest suffices: every other checkpoint and every entry
     was proven above to lie in its tree, so a witness that cosigned it vouches for them all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from audit.bundle import ENTRIES, MANIFEST, BundleReader, Manifest, checkpoint_name
from audit.bundle_json import (
    MAX_CHECKPOINT_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_STATE_BYTES,
    parse_entry,
    parse_json,
)
from audit.canonical import canonicalize
from audit.checkpoint import Checkpoint, open_checkpoint
from audit.cosignature import CosignerKey, verify_cosignatures
from audit.encoding import decode_base64, encode_base64
from audit.errors import (
    AuditError,
    BundleFormatError,
    CanonicalJsonError,
    NoteFormatError,
    SignatureError,
    VerificationError,
)
from audit.merkle import TreeFrontier, hash_leaf
from audit.note import SignedNote, VerifierKey

STATE_FORMAT = "inferno-audit-state/1"
_CHECKPOINT_FILE = re.compile(r"checkpoints/(0|[1-9][0-9]*)\.txt")


@dataclass(frozen=True)
class VerifiedState:
    """What an auditor verified last time: a signed tree size and root of one log."""

    origin: str
    size: int
    root: bytes
    verified_at: str

    def to_json(self) -> bytes:
        return (
            json.dumps(
                {
                    "format": STATE_FORMAT,
                    "origin": self.origin,
                    "size": self.size,
                    "root": encode_base64(self.root),
                    "verified_at": self.verified_at,
                },
                indent=2,
            ).encode()
            + b"\n"
        )

    @classmethod
    def parse(cls, data: bytes, source: str) -> VerifiedState:
        """Parse a state file within the limits of audit.bundle_json. Raises
        BundleFormatError."""
        raw = parse_json(data, what=f"state file {source}", max_bytes=MAX_STATE_BYTES)
        try:
            if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
                raise ValueError(f"not an {STATE_FORMAT} file")
            state = cls(
                origin=str(raw["origin"]),
                size=int(raw["size"]),
                root=decode_base64(str(raw["root"]), "root"),
                verified_at=str(raw["verified_at"]),
            )
        except (ValueError, KeyError, TypeError, AuditError) as exc:
            raise BundleFormatError(f"state file {source} is unusable: {exc}") from exc
        if len(state.root) != 32 or state.size < 1:
            raise BundleFormatError(f"state file {source} holds no valid tree size and root")
        return state


@dataclass(frozen=True)
class VerificationReport:
    origin: str
    first_index: int
    num_entries: int
    first_time: str | None
    last_time: str | None
    checkpoint_sizes: list[int]
    state_checked_at: int | None
    new_state: VerifiedState
    witnessed_by: list[str]


def verify_bundle(
    path: Path,
    vkey: VerifierKey,
    state: VerifiedState | None = None,
    witnesses: Sequence[CosignerKey] = (),
    min_witnesses: int = 0,
) -> VerificationReport:
    """Run every check on the bundle at `path` (directory or tar); see the module docstring.

    `witnesses` are the pinned witness keys; `min_witnesses` how many of them must have cosigned
    the newest checkpoint (0: cosignatures are checked if present, none is required).
    """
    if not 0 <= min_witnesses <= len(witnesses):
        raise BundleFormatError(
            f"cannot require {min_witnesses} cosignatures of {len(witnesses)} pinned witness "
            "keys: pin at least that many with --witness"
        )
    if len({(w.name, w.key_id) for w in witnesses}) != len(witnesses):
        raise BundleFormatError("a witness key is pinned twice: each counts once")
    with BundleReader(path) as bundle:
        manifest = Manifest.parse(bundle.read(MANIFEST, max_bytes=MAX_MANIFEST_BYTES))
        if manifest.origin != vkey.name:
            raise VerificationError(
                f"the bundle is of log {manifest.origin!r} but the pinned key is {vkey.name!r}"
            )
        if state is not None and state.origin != manifest.origin:
            raise BundleFormatError(
                f"the state file is for log {state.origin!r}, not {manifest.origin!r}"
            )
        # Step 1: checkpoints.
        signed = _verify_checkpoints(bundle, vkey, manifest, state)
        # Step 2: the state must lie within the bundle.
        end = manifest.first_index + manifest.num_entries
        if state is not None:
            if state.size < manifest.first_index:
                raise VerificationError(
                    f"continuity: the state's tree size {state.size} precedes this bundle's first "
                    f"entry {manifest.first_index}; export from index {state.size} or earlier"
                )
            if state.size > end:
                raise VerificationError(
                    f"truncated history: size {state.size} was verified before, but this bundle "
                    f"ends at {end} entries (an older export, or the log was truncated)"
                )
        # Step 3: entries, roots.
        num_lines, first_time, last_time = _verify_entries(bundle, manifest, signed, state)
        # Step 5 (reads the checkpoints again, while the bundle is open): cosignatures.
        witnessed_by = _verify_witnesses(bundle, sorted(signed), witnesses, min_witnesses)
    # Step 4: coverage.
    present = manifest.first_index + num_lines
    for size in sorted(signed):
        if size > present:
            raise VerificationError(
                f"truncation: {checkpoint_name(size)} signs {size} entries but the bundle holds "
                f"entries only up to index {present - 1}"
            )
    last_signed = max(signed)
    if present > last_signed:
        raise VerificationError(
            f"unsigned entries: entries {last_signed} to {present - 1} are covered by no signed "
            "checkpoint"
        )
    if num_lines != manifest.num_entries:
        raise VerificationError(
            f"{MANIFEST} declares {manifest.num_entries} entries but {ENTRIES} holds {num_lines}"
        )
    newest = signed[last_signed]
    if state is not None and state.size > newest.size:
        new_state = state
    else:
        verified_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        new_state = VerifiedState(manifest.origin, newest.size, newest.root, verified_at)
    return VerificationReport(
        origin=manifest.origin,
        first_index=manifest.first_index,
        num_entries=num_lines,
        first_time=first_time,
        last_time=last_time,
        checkpoint_sizes=sorted(signed),
        state_checked_at=None if state is None else state.size,
        new_state=new_state,
        witnessed_by=witnessed_by,
    )


def _verify_witnesses(
    bundle: BundleReader,
    sizes: Sequence[int],
    witnesses: Sequence[CosignerKey],
    min_witnesses: int,
) -> list[str]:
    """The names of the pinned witnesses that cosigned the newest checkpoint (step 5)."""
    cosigned: list[str] = []
    for size in sizes:
        name = checkpoint_name(size)
        note = SignedNote.parse(bundle.read(name, max_bytes=MAX_CHECKPOINT_BYTES))
        try:
            cosigned = [c.witness.name for c in verify_cosignatures(note, witnesses)]
        except SignatureError as exc:
            raise VerificationError(f"{name}: {exc}") from exc
    if len(cosigned) < min_witnesses:
        missing = [w.name for w in witnesses if w.name not in cosigned]
        raise VerificationError(
            f"witnesses: {checkpoint_name(sizes[-1])} (the newest checkpoint) carries valid "
            f"cosignatures from {len(cosigned)} of the pinned witnesses, {min_witnesses} are "
            f"required; none from {', '.join(missing)}"
        )
    return cosigned


def _verify_checkpoints(
    bundle: BundleReader, vkey: VerifierKey, manifest: Manifest, state: VerifiedState | None
) -> dict[int, Checkpoint]:
    by_file: dict[str, Checkpoint] = {}
    for name in bundle.checkpoint_files():
        try:
            by_file[name] = open_checkpoint(bundle.read(name, max_bytes=MAX_CHECKPOINT_BYTES), vkey)
        except NoteFormatError as exc:
            raise BundleFormatError(f"{name} is not a well-formed checkpoint: {exc}") from exc
        except SignatureError as exc:
            raise VerificationError(f"{name}: {exc}") from exc
    if not by_file:
        raise VerificationError("the bundle holds no signed checkpoint")
    signed: dict[int, tuple[str, Checkpoint]] = {}
    if state is not None:
        signed[state.size] = ("the state file", Checkpoint(state.origin, state.size, state.root))
    for name, checkpoint in by_file.items():
        seen = signed.get(checkpoint.size)
        if seen is not None and seen[1].root != checkpoint.root:
            raise VerificationError(
                f"equivocation: {name} and {seen[0]} give different roots for tree size "
                f"{checkpoint.size}, both signed by the log's key"
            )
        signed[checkpoint.size] = (name, checkpoint)
    for name, checkpoint in by_file.items():
        if not _CHECKPOINT_FILE.fullmatch(name) or name != checkpoint_name(checkpoint.size):
            raise VerificationError(
                f"{name} holds the checkpoint of size {checkpoint.size}; expected it in "
                f"{checkpoint_name(checkpoint.size)}"
            )
        if checkpoint.size < manifest.first_index:
            raise VerificationError(
                f"{name} signs size {checkpoint.size}, before the bundle's first entry "
                f"{manifest.first_index}: its root cannot be checked"
            )
    sizes = sorted(c.size for c in by_file.values())
    if sizes != sorted(manifest.checkpoint_sizes):
        missing = sorted(set(manifest.checkpoint_sizes) - set(sizes))
        raise VerificationError(
            f"{MANIFEST} lists checkpoint sizes {sorted(manifest.checkpoint_sizes)} but the bundle "
            f"holds {sizes}" + (f" ({checkpoint_name(missing[0])} is missing)" if missing else "")
        )
    return {c.size: c for c in by_file.values()}


def _verify_entries(
    bundle: BundleReader,
    manifest: Manifest,
    signed: dict[int, Checkpoint],
    state: VerifiedState | None,
) -> tuple[int, str | None, str | None]:
    frontier = TreeFrontier(manifest.first_index, manifest.prefix)
    _check_roots(frontier, signed, state)
    first_time = last_time = None
    for line_number, line in enumerate(bundle.entry_lines(), start=1):
        index = manifest.first_index + line_number - 1
        where = f"{ENTRIES} line {line_number} (entry {index})"
        if not line.endswith(b"\n"):
            raise BundleFormatError(f"{where} does not end with a newline")
        data = line[:-1]
        entry = _parse_entry(data, where)
        if entry.get("index") != index:
            raise VerificationError(
                f"{where} claims index {entry.get('index')!r}: entries were inserted, "
                "deleted or reordered"
            )
        try:
            canonical = canonicalize(entry) == data
        except CanonicalJsonError:
            canonical = False
        if not canonical:
            raise VerificationError(f"{where} is not in RFC 8785 canonical form: it was edited")
        time = entry.get("time")
        if isinstance(time, str):
            first_time = first_time or time
            last_time = time
        frontier.append(hash_leaf(data))
        _check_roots(frontier, signed, state)
    return frontier.size - manifest.first_index, first_time, last_time


def _parse_entry(data: bytes, where: str) -> dict[str, object]:
    entry = parse_entry(data, what=where)
    if not isinstance(entry, dict):
        raise BundleFormatError(f"{where} is not a JSON object")
    return entry


def _check_roots(
    frontier: TreeFrontier, signed: dict[int, Checkpoint], state: VerifiedState | None
) -> None:
    size = frontier.size
    checkpoint = signed.get(size)
    state_root = state.root if state is not None and state.size == size else None
    if checkpoint is None and state_root is None:
        return
    root = frontier.root()
    if checkpoint is not None and root != checkpoint.root:
        raise VerificationError(
            f"root mismatch at {checkpoint_name(size)}: the entries before it hash to "
            f"{encode_base64(root)}, the log signed {encode_base64(checkpoint.root)} "
            "(entries were modified, inserted, deleted or swapped)"
        )
    if state_root is not None and root != state_root:
        raise VerificationError(
            f"history rewritten: the first {size} entries now hash to {encode_base64(root)}, "
            f"but {encode_base64(state_root)} was verified before (state file)"
        )
