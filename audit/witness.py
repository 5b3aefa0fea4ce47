"""A transparency log witness (c2sp.org/tlog-witness): the pure core of `add-checkpoint`.

The witness keeps, per log origin, the latest checkpoint it cosigned (the log's signed note,
verbatim), and cosigns a new one only if it is proven to extend that one. So it never cosigns
two different trees of one size, nor a smaller tree after a larger one: a log that shows one
auditor a checkpoint and another a different checkpoint of the same size (a split view) cannot
have both cosigned by an honest witness.

An add-checkpoint request, in the order the spec's section "add-checkpoint" gives:
  1. parse the body: `old N`, at most 63 base64 proof hashes, a blank line, the signed
     checkpoint (400 if malformed);
  2. the checkpoint's origin must be a configured log (404) and a signature by its pinned key
     must verify (403); signatures by other keys are ignored;
  3. the old size must not exceed the checkpoint's size (400);
  4. the old size must be the size of the latest cosigned checkpoint, or 0 if none
     (409, answering that size);
  5. at equal sizes, the roots must be equal (409: a split view); otherwise the consistency
     proof from the cosigned checkpoint must verify (422), and be empty from size 0;
  6. the new checkpoint is written durably to the state file, then cosigned (200).
Steps 4 to 6 hold one lock, so that two requests cannot roll the state back (the race the spec
describes); a refusal leaves the state as it was. A request refused at step 5 is kept, as the
log signed it, in the evidence folder beside the state file.

Standard library and `cryptography` only: a customer's security team runs it on its own host
(`python -m audit witness`, served by audit.witness_server).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from audit.checkpoint import Checkpoint
from audit.cosignature import Cosigner
from audit.encoding import decode_base64, parse_decimal
from audit.errors import (
    AuditError,
    InconsistentCheckpointError,
    MerkleError,
    OldSizeConflictError,
    SignatureError,
    SplitViewError,
    UnknownLogError,
    UntrustedCheckpointError,
    WitnessRefusedError,
    WitnessStateError,
)
from audit.keyfile import write_file_atomically
from audit.merkle import verify_consistency
from audit.note import SignedNote, VerifierKey

logger = logging.getLogger(__name__)

# "The client MUST NOT send more than 63 consistency proof lines."
MAX_PROOF_LINES = 63
# 63 proof lines of 45 bytes, and a checkpoint with up to signed-note's 100 signature lines.
MAX_REQUEST_BYTES = 64 << 10
MAX_STATE_BYTES = 16 << 20
STATE_FORMAT = "inferno-witness-state/1"
# Refused requests the log signed are kept in <state file>.evidence/, up to this many.
EVIDENCE_SUFFIX = ".evidence"
MAX_EVIDENCE_FILES = 1000
_OLD_PREFIX = "old "


@dataclass(frozen=True)
class AddCheckpointRequest:
    """A parsed add-checkpoint body; the checkpoint's signatures are not verified yet."""

    old_size: int
    proof: Sequence[bytes]
    note_text: str
    note: SignedNote
    checkpoint: Checkpoint

    @classmethod
    def parse(cls, body: bytes) -> AddCheckpointRequest:
        """Parse a request body of at most MAX_REQUEST_BYTES; raises WitnessRefusedError (400)."""
        if len(body) > MAX_REQUEST_BYTES:
            raise WitnessRefusedError(f"the request is larger than {MAX_REQUEST_BYTES} bytes")
        try:
            text = body.decode("utf-8")
            head, sep, note_text = text.partition("\n\n")
            if not sep:
                raise WitnessRefusedError("the request has no blank line before the checkpoint")
            lines = head.split("\n")
            if len(lines) > 1 + MAX_PROOF_LINES:
                raise WitnessRefusedError(f"the proof has more than {MAX_PROOF_LINES} lines")
            if not lines[0].startswith(_OLD_PREFIX):
                raise WitnessRefusedError("the request does not start with an 'old N' line")
            old_size = parse_decimal(lines[0][len(_OLD_PREFIX) :], "old size")
            proof = [decode_base64(line, f"proof line {i}") for i, line in enumerate(lines[1:])]
            note = SignedNote.parse(note_text)
            checkpoint = Checkpoint.from_text(note.text)
        except UnicodeDecodeError:
            raise WitnessRefusedError("the request is not UTF-8") from None
        except WitnessRefusedError:
            raise
        except AuditError as exc:
            raise WitnessRefusedError(f"malformed request: {exc}") from exc
        return cls(old_size, proof, note_text, note, checkpoint)


class WitnessState:
    """The latest cosigned checkpoint of each log, kept in one file the witness owns.

    The file holds each log's signed note verbatim, and is re-verified against the logs' keys
    when read; it is replaced atomically (audit.keyfile.write_file_atomically) on each update.
    """

    def __init__(self, path: Path, logs: dict[str, VerifierKey]) -> None:
        self.path = path
        self._notes: dict[str, str] = {}
        self.latest: dict[str, Checkpoint] = {}
        self._load(logs)

    def _load(self, logs: dict[str, VerifierKey]) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise WitnessStateError(f"cannot read witness state {self.path}: {exc}") from exc
        if len(data) > MAX_STATE_BYTES:
            raise WitnessStateError(f"witness state {self.path} is over {MAX_STATE_BYTES} bytes")
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
                raise ValueError(f"not an {STATE_FORMAT} file")
            notes = raw["logs"]
            if not isinstance(notes, dict) or not all(isinstance(n, str) for n in notes.values()):
                raise ValueError("'logs' must map each origin to a signed checkpoint")
        except (ValueError, KeyError, RecursionError) as exc:
            raise WitnessStateError(f"witness state {self.path} is unusable: {exc}") from exc
        for origin, note in notes.items():
            verifier = logs.get(origin)
            if verifier is None:
                # A log no longer configured: keep its record, so re-adding it resumes there.
                self._notes[origin] = note
                continue
            try:
                self.latest[origin] = _open(SignedNote.parse(note), verifier)
            except AuditError as exc:
                raise WitnessStateError(
                    f"witness state {self.path}: the checkpoint of {origin!r} is not signed by "
                    f"its key: {exc}"
                ) from exc
            self._notes[origin] = note

    def record(self, checkpoint: Checkpoint, note: str) -> None:
        """Durably replace the log's latest cosigned checkpoint; raises OSError if it cannot."""
        notes = {**self._notes, checkpoint.origin: note}
        content = json.dumps({"format": STATE_FORMAT, "logs": notes}, indent=2) + "\n"
        write_file_atomically(self.path, content.encode())
        self._notes = notes
        self.latest[checkpoint.origin] = checkpoint


def _open(note: SignedNote, verifier: VerifierKey) -> Checkpoint:
    checkpoint = Checkpoint.from_text(note.open(verifier))
    if checkpoint.origin != verifier.name:
        raise SignatureError(f"checkpoint of {checkpoint.origin!r} signed by {verifier.name!r}")
    return checkpoint


class Witness:
    """Cosigns checkpoints of the configured logs that extend what it cosigned before."""

    def __init__(self, cosigner: Cosigner, logs: Sequence[VerifierKey], state_path: Path) -> None:
        self.cosigner = cosigner
        self._logs = {log.name: log for log in logs}
        if len(self._logs) != len(logs):
            raise WitnessStateError("two log keys name the same origin")
        self._state = WitnessState(state_path, self._logs)
        self._evidence_dir = state_path.with_name(state_path.name + EVIDENCE_SUFFIX)
        self._lock = threading.Lock()

    def latest(self, origin: str) -> Checkpoint | None:
        return self._state.latest.get(origin)

    def add_checkpoint(self, body: bytes, now: int) -> str:
        """Handle one add-checkpoint body (the plan in the module docstring) at POSIX time
        `now`; return the cosignature line. Raises a WitnessRefusedError naming its status."""
        request = AddCheckpointRequest.parse(body)
        checkpoint = request.checkpoint
        verifier = self._logs.get(checkpoint.origin)
        if verifier is None:
            raise UnknownLogError(f"this witness does not witness the log {checkpoint.origin!r}")
        try:
            request.note.open(verifier)
        except SignatureError as exc:
            raise UntrustedCheckpointError(f"checkpoint of {checkpoint.origin!r}: {exc}") from exc
        if request.old_size > checkpoint.size:
            raise WitnessRefusedError(
                f"old size {request.old_size} is larger than the checkpoint's {checkpoint.size}"
            )
        with self._lock:
            try:
                self._check_extends(request)
            except (SplitViewError, InconsistentCheckpointError):
                self._keep_evidence(body, request, now)
                raise
            self._state.record(checkpoint, request.note_text)
        return self.cosigner.cosign(request.note.text, now)

    def _keep_evidence(self, body: bytes, request: AddCheckpointRequest, now: int) -> None:
        """Keep a refused request the log signed (the spec allows a witness to log it). For a
        split view, beside the checkpoint in the state, it proves to anyone with the log's vkey
        that the log signed two roots for one size; a 422's is a lead (a wrong proof alone
        proves no fork). At most MAX_EVIDENCE_FILES."""
        folder = self._evidence_dir
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            if sum(1 for _ in folder.iterdir()) >= MAX_EVIDENCE_FILES:
                logger.warning("evidence folder %s is full; this refusal is not kept", folder)
                return
            name = f"{now}-{request.checkpoint.size}-{hashlib.sha256(body).hexdigest()[:16]}.txt"
            write_file_atomically(folder / name, body)
        except OSError as exc:
            logger.error("evidence of a refused checkpoint could not be kept: %s", exc)
            return
        logger.warning("kept the refused checkpoint as evidence: %s", folder / name)

    def _check_extends(self, request: AddCheckpointRequest) -> None:
        checkpoint = request.checkpoint
        latest = self._state.latest.get(checkpoint.origin)
        latest_size = 0 if latest is None else latest.size
        if request.old_size != latest_size:
            raise OldSizeConflictError(latest_size)
        if latest is None:
            if request.proof:
                raise InconsistentCheckpointError("a proof from size 0 must be empty")
            return
        if latest.size == checkpoint.size and latest.root != checkpoint.root:
            logger.warning(
                "split view: log %s signed two roots for size %d; the second is refused",
                checkpoint.origin,
                checkpoint.size,
            )
            raise SplitViewError(
                f"this witness cosigned another root for size {checkpoint.size} of "
                f"{checkpoint.origin!r}: the log shows two different trees of one size"
            )
        try:
            verify_consistency(
                latest.size, checkpoint.size, request.proof, latest.root, checkpoint.root
            )
        except MerkleError as exc:
            logger.warning(
                "log %s: checkpoint of size %d does not extend the cosigned size %d: %s",
                checkpoint.origin,
                checkpoint.size,
                latest.size,
                exc,
            )
            raise InconsistentCheckpointError(
                f"the checkpoint of size {checkpoint.size} is not proven to extend the one of "
                f"size {latest.size} this witness cosigned: {exc}"
            ) from exc
