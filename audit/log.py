"""The audit log service: appends with group commit, checkpoints, heartbeats and receipts.

One `AuditLog` per appliance process. A single writer thread owns all appends: callers enqueue an
event and wait for its receipt, and the writer commits whatever has queued up meanwhile in one
transaction (group commit), then signs a checkpoint when the policy says so. Appends fail closed:
`append` returns only once the entry is durably stored and raises `AuditWriteError` otherwise.

    log = AuditLog.open(AuditLogSettings(origin=..., database_url=..., key_dir=...))
    receipt = await log.append_async(event)      # or log.append(event) from a worker thread
    response.headers["Audit-Entry"] = receipt.header_value()
    proof_text = log.proof(index)                # GET /v1/audit/proof/<index>
    log.close()                                   # signs a final checkpoint
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from audit.checkpoint import Checkpoint
from audit.commitment import ContentCommitter
from audit.errors import (
    AuditClosedError,
    AuditError,
    AuditStoreError,
    AuditWriteError,
    SignerRefusedError,
    UnknownEntryError,
)
from audit.event import Action, AuditEvent, Outcome, system_event
from audit.policy import CheckpointPolicy
from audit.signer import CheckpointSigner, load_or_create_note_signer
from audit.store import AuditReceipt, AuditStore, StoredCheckpoint
from audit.tlog_proof import TlogProof
from audit.witness_client import WitnessEndpoint
from audit.witnessing import CheckpointWitnessing

logger = logging.getLogger(__name__)

SIGNING_KEY_FILE = "log-signing.key"
SIGNER_STATE_FILE = "log-signer-state.note"
COMMITMENT_KEY_FILE = "commitment.key"


@dataclass(frozen=True)
class AuditLogSettings:
    """What the log needs: its origin (also its key name), its database, and its key directory.

    The key directory holds the Ed25519 signing key, the signer's record of its last checkpoint
    and the commitment key, each created at first start with mode 0600. `commitment_key_file`
    names an existing commitment key elsewhere instead (one key for a whole deployment).
    Each checkpoint is sent to the `witnesses` (audit.witnessing), each call within
    `witness_timeout_s`.
    """

    origin: str
    database_url: str
    key_dir: Path
    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    max_batch: int = 1024
    commitment_key_file: Path | None = None
    witnesses: tuple[WitnessEndpoint, ...] = ()
    witness_timeout_s: float = 5.0


@dataclass
class _Append:
    """An event to store, and where its outcome goes: a thread's Future (`loop` None), or an
    asyncio future of `loop`, which the writer settles with one call into that loop per batch
    rather than one wake-up per entry."""

    event: AuditEvent
    future: Future[AuditReceipt] | asyncio.Future[AuditReceipt]
    loop: asyncio.AbstractEventLoop | None = None


_Result = AuditReceipt | BaseException


def _settle(appends: Sequence[_Append], outcomes: Sequence[_Result]) -> None:
    """Give each append its receipt or error; a future already done (its waiter cancelled)
    is left alone. Thread futures are set here, each loop's futures in that loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Append, _Result]]] = {}
    for append, outcome in zip(appends, outcomes, strict=True):
        if append.loop is None:
            _set_outcome(append.future, outcome)
        else:
            by_loop.setdefault(append.loop, []).append((append, outcome))
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_set_outcomes, settled)


def _set_outcomes(settled: list[tuple[_Append, _Result]]) -> None:
    for append, outcome in settled:
        _set_outcome(append.future, outcome)


def _set_outcome(
    future: Future[AuditReceipt] | asyncio.Future[AuditReceipt], outcome: _Result
) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


@dataclass
class _Checkpoint:
    future: Future[StoredCheckpoint | None]


_STOP = object()


class AuditLog:
    """The appliance's signed, append-only audit log. Thread-safe; see the module docstring."""

    def __init__(
        self,
        store: AuditStore,
        signer: CheckpointSigner,
        committer: ContentCommitter,
        settings: AuditLogSettings,
        *,
        size: int,
        checkpointed_size: int,
    ) -> None:
        self.store = store
        self.committer = committer
        self._signer = signer
        self._settings = settings
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        # The batch the writer took off the queue: failed too if the writer dies holding it.
        self._in_hand: list[object] = []
        self._closed = threading.Event()
        self._broken: str | None = None
        self._checkpointed_size = checkpointed_size
        self._size = size
        now = time.monotonic()
        self._oldest_pending_at = now
        self._last_append_at = now
        self._writer = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._witnessing = (
            CheckpointWitnessing(store, settings.witnesses, settings.witness_timeout_s)
            if settings.witnesses
            else None
        )

    @classmethod
    def open(cls, settings: AuditLogSettings) -> AuditLog:
        """Open the store and keys, check the database against the last signed checkpoint,
        sign any entries a crash left unsigned, and start the writer.

        Raises AuditError (AuditStoreError, KeyFileError ...) if any of it fails: the caller
        must not serve without its audit log.
        """
        key_dir = settings.key_dir
        note_signer = load_or_create_note_signer(key_dir / SIGNING_KEY_FILE, settings.origin)
        signer = CheckpointSigner(note_signer, key_dir / SIGNER_STATE_FILE)
        if settings.commitment_key_file is None:
            committer = ContentCommitter.load_or_create(key_dir / COMMITMENT_KEY_FILE)
        else:
            committer = ContentCommitter.load(settings.commitment_key_file)
        store = AuditStore.open(settings.database_url, settings.origin)
        try:
            _check_store_extends_signed(store, signer)
            latest = store.latest_checkpoint()
            log = cls(
                store,
                signer,
                committer,
                settings,
                size=store.size(),
                checkpointed_size=0 if latest is None else latest.size,
            )
            log._checkpoint()
            if log._broken is not None:
                raise AuditStoreError(log._broken)
        except BaseException:
            store.close()
            raise
        if log._witnessing is not None:
            log._witnessing.start()
            latest = store.latest_checkpoint()
            if latest is not None:  # witnesses that missed it (down, or added since) get it now
                log._witnessing.submit(latest.size)
        log._writer.start()
        return log

    @property
    def origin(self) -> str:
        return self._settings.origin

    @property
    def vkey(self) -> str:
        """The verifier key admins pin out of band to verify checkpoints and exports."""
        return str(self._signer.verifier)

    @property
    def failure(self) -> str | None:
        """Why the log refuses every new entry for good (its writer died, or the database no
        longer extends what it signed), or None while it takes entries. Closing is not a
        failure, and neither is one append that failed (the next may succeed)."""
        return self._broken

    # -- appending -------------------------------------------------------------------------

    def submit(self, event: AuditEvent) -> Future[AuditReceipt]:
        """Queue `event`; the future resolves to its receipt once stored, or to the error."""
        future: Future[AuditReceipt] = Future()
        self._enqueue(_Append(event, future))
        return future

    def append(self, event: AuditEvent) -> AuditReceipt:
        """Store `event` durably and return its receipt; raises AuditWriteError if it cannot."""
        return self.submit(event).result()

    async def append_async(self, event: AuditEvent) -> AuditReceipt:
        """`append` for the event loop: waits for the writer without blocking the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[AuditReceipt] = loop.create_future()
        self._enqueue(_Append(event, future, loop))
        return await future

    def _enqueue(self, append: _Append) -> None:
        if self._broken is not None:
            append.future.set_exception(AuditWriteError(self._broken))
        elif self._closed.is_set():
            append.future.set_exception(AuditClosedError("the audit log is closed"))
        else:
            self._queue.put(append)

    def checkpoint(self) -> StoredCheckpoint | None:
        """Sign a checkpoint of everything appended so far (None while the log is empty)."""
        future: Future[StoredCheckpoint | None] = Future()
        if self._closed.is_set():
            raise AuditClosedError("the audit log is closed")
        self._queue.put(_Checkpoint(future))
        return future.result()

    def wait_for_witnesses(self, size: int) -> bool:
        """Wait (bounded by the witnesses' timeouts) until every witness was asked to cosign a
        checkpoint of at least `size`; True at once without witnesses. Whether each one
        cosigned shows in the stored note."""
        return self._witnessing is None or self._witnessing.wait(size)

    # -- reading ---------------------------------------------------------------------------

    def proof(self, index: int) -> str:
        """A c2sp.org/tlog-proof of entry `index` under the latest checkpoint (signing a new
        one first if the entry is newer than it). Raises UnknownEntryError if no such entry."""
        if not 0 <= index < self.store.size():
            raise UnknownEntryError(f"the log has no entry at index {index}")
        latest = self.store.latest_checkpoint()
        if latest is None or latest.size <= index:
            latest = self.checkpoint()
        if latest is None or latest.size <= index:
            raise AuditStoreError(f"no checkpoint covering entry {index} could be signed")
        proof = self.store.inclusion_proof(index, latest.size)
        return TlogProof(index, proof, latest.note).to_text()

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting entries, commit what is queued, sign a final checkpoint, disconnect."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._queue.put(_STOP)
        self._writer.join()
        if self._witnessing is not None:  # the final checkpoint, if the witnesses answer in time
            self._witnessing.close()
        self.store.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._write_until_stopped()
        except BaseException:  # logged with its traceback; every waiting append fails below
            logger.exception("audit writer stopped unexpectedly; the log refuses new entries")
            self._broken = "the audit writer stopped unexpectedly"
        finally:
            self._closed.set()
            self._fail_queued()

    def _write_until_stopped(self) -> None:
        policy = self._settings.policy
        while True:
            timeout = policy.seconds_until_due(
                num_pending=self._size - self._checkpointed_size,
                oldest_pending_at=self._oldest_pending_at,
                last_append_at=self._last_append_at,
                now=time.monotonic(),
            )
            batch = self._in_hand = self._take_batch(timeout)
            appends = [item for item in batch if isinstance(item, _Append)]
            if appends:
                self._commit(appends)
            now = time.monotonic()
            if policy.heartbeat_due(last_append_at=self._last_append_at, now=now):
                self._last_append_at = now  # if it fails, retry in an interval, not in a loop
                self._commit([_Append(_heartbeat(self._size), Future())])
                self._checkpoint()
            elif any(isinstance(item, _Checkpoint) for item in batch) or policy.checkpoint_due(
                num_pending=self._size - self._checkpointed_size,
                oldest_pending_at=self._oldest_pending_at,
                now=now,
            ):
                self._checkpoint()
            for item in batch:
                if isinstance(item, _Checkpoint) and not item.future.done():
                    item.future.set_result(self.store.latest_checkpoint())
            if _STOP in batch:
                self._checkpoint()
                return

    def _take_batch(self, timeout: float) -> list[object]:
        try:
            batch = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        appends = 0
        while appends < self._settings.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
            appends += isinstance(item, _Append)
        return batch

    def _commit(self, appends: list[_Append]) -> None:
        if self._broken is not None:
            error: AuditError = AuditWriteError(self._broken)
        else:
            try:
                receipts = self.store.append([a.event for a in appends])
            except AuditError as exc:
                logger.error("audit append of %d entries failed: %s", len(appends), exc)
                error = exc
            else:
                if self._size == self._checkpointed_size:
                    self._oldest_pending_at = time.monotonic()
                self._size = receipts[-1].index + 1
                self._last_append_at = time.monotonic()
                _settle(appends, receipts)
                return
        _settle(appends, [error] * len(appends))

    def _checkpoint(self) -> None:
        """Sign and store a checkpoint of the current size, if it grew since the last one."""
        if self._broken is not None:
            return
        try:
            size = self.store.size()
            if size == 0 or size == self._checkpointed_size:
                return
            last = self._signer.last_signed
            proof = [] if last is None else self.store.consistency_proof(last.size, size)
            checkpoint = Checkpoint(self.origin, size, self.store.root(size))
            note = self._signer.sign(checkpoint, proof)
            self.store.add_checkpoint(size, note, datetime.now(UTC))
        except SignerRefusedError as exc:
            # The database no longer extends what this log signed: stop taking entries.
            self._broken = f"the audit log refuses new entries: {exc}"
            logger.critical("%s", self._broken)
            return
        except AuditError as exc:
            logger.error("audit checkpoint failed (will retry): %s", exc)
            self._oldest_pending_at = time.monotonic()  # retry after an interval, not in a loop
            return
        self._checkpointed_size = size
        logger.debug("audit checkpoint signed at size %d", size)
        if self._witnessing is not None:
            self._witnessing.submit(size)

    def _fail_queued(self) -> None:
        """Fail every append and checkpoint still waiting: queued, or in the batch in hand."""
        error = AuditClosedError(self._broken or "the audit log is closed")
        waiting = self._in_hand
        while True:
            try:
                waiting.append(self._queue.get_nowait())
            except queue.Empty:
                break
        appends = [item for item in waiting if isinstance(item, _Append)]
        _settle(appends, [error] * len(appends))
        for item in waiting:
            if isinstance(item, _Checkpoint) and not item.future.done():
                item.future.set_exception(error)


def _heartbeat(size: int) -> AuditEvent:
    return system_event(
        Action.AUDIT_HEARTBEAT,
        time=datetime.now(UTC),
        outcome=Outcome.SUCCESS,
        details={"tree_size": size},
    )


def _check_store_extends_signed(store: AuditStore, signer: CheckpointSigner) -> None:
    """Refuse a database that lost or changed entries this log has already signed."""
    last = signer.last_signed
    if last is None:
        return
    size = store.size()
    if size < last.size:
        raise AuditStoreError(
            f"the audit database holds {size} entries but this log signed a checkpoint of "
            f"{last.size}: the database was rolled back, truncated or replaced"
        )
    if store.root(last.size) != last.root:
        raise AuditStoreError(
            f"the audit database's first {last.size} entries do not hash to the root this log "
            "signed: its history was rewritten"
        )
