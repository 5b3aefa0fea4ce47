"""Witnessing the log's checkpoints, off the request path.

The audit writer signs a checkpoint and hands its size to `CheckpointWitnessing.submit`, which
returns at once; a thread of its own sends the newest checkpoint to each witness
(audit.witness_client) and appends the cosignatures it gets to the checkpoint's stored note. So
a slow or dead witness never delays an append: it costs at most its timeout on this thread, is
logged, and is asked again with the next checkpoint. Checkpoints signed while a round is under
way are coalesced: only the newest is sent next, which vouches for every older one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import UTC, datetime

from audit.checkpoint import Checkpoint
from audit.errors import AuditError, WitnessDisagreesError
from audit.note import SignedNote
from audit.store import AuditStore
from audit.witness_client import WitnessClient, WitnessEndpoint

logger = logging.getLogger(__name__)


class CheckpointWitnessing:
    """Sends each new checkpoint of `store` to the `witnesses`, from one thread."""

    def __init__(
        self, store: AuditStore, witnesses: Sequence[WitnessEndpoint], timeout_s: float
    ) -> None:
        self._store = store
        self._clients = [WitnessClient(w, timeout_s) for w in witnesses]
        # The longest a round takes: each witness's timeout twice (a 409 retries once).
        self._round_s = 2 * timeout_s * len(witnesses) + 1.0
        self._changed = threading.Condition()
        self._wanted_size = 0  # the newest checkpoint submitted
        self._done_size = 0  # the newest checkpoint every witness was asked to cosign
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="audit-witnessing", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, size: int) -> None:
        """Have the checkpoint of `size` witnessed soon; returns at once."""
        with self._changed:
            if size > self._wanted_size:
                self._wanted_size = size
                self._changed.notify_all()

    def wait(self, size: int) -> bool:
        """Wait until every witness was asked about a checkpoint of at least `size` (whether it
        cosigned or not shows in the stored note); False if the witnesses took longer than two
        rounds (the one under way, and the one that sends `size`)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._done_size >= size, 2 * self._round_s)

    def close(self) -> None:
        """Send what was submitted, within two rounds, then stop the thread."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join(2 * self._round_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._wanted_size > self._done_size or self._stopping
                )
                if self._wanted_size <= self._done_size:
                    return
                size = self._wanted_size
            try:
                self._witness(size)
            except Exception:  # the thread outlives any one round; the next checkpoint retries
                logger.exception("witnessing audit checkpoint %d failed", size)
            with self._changed:
                self._done_size = max(self._done_size, size)
                self._changed.notify_all()

    def _witness(self, size: int) -> None:
        try:
            [stored] = self._store.checkpoints(size, size)
            note = stored.note
            checkpoint = Checkpoint.from_text(SignedNote.parse(note).text)
        except (AuditError, ValueError) as exc:
            logger.error("audit checkpoint %d cannot be sent to witnesses: %s", size, exc)
            return
        lines = []
        for client in self._clients:
            try:
                lines.append(client.cosign(note, checkpoint, self._store.consistency_proof))
            except WitnessDisagreesError as exc:
                logger.error(
                    "audit checkpoint %d refused by witness %s as inconsistent with what it "
                    "cosigned (a forked tree or a restored database? compare with the witness's "
                    "state): %s",
                    size,
                    client.endpoint.name,
                    exc,
                )
            except AuditError as exc:
                logger.warning(
                    "audit checkpoint %d not cosigned by witness %s (asked again with the next "
                    "checkpoint): %s",
                    size,
                    client.endpoint.name,
                    exc,
                )
        if lines:
            self._store.add_cosignatures(size, lines, datetime.now(UTC))
            logger.debug("audit checkpoint %d cosigned by %d witnesses", size, len(lines))
