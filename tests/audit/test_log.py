"""The AuditLog service on SQLite and PostgreSQL: receipts, group commit, checkpoints, heartbeats,
proofs, and failing closed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from audit.checkpoint import open_checkpoint
from audit.commitment import ContentCommitter
from audit.errors import (
    AuditClosedError,
    AuditStoreError,
    AuditWriteError,
    KeyFileError,
    UnknownEntryError,
    VerificationError,
)
from audit.event import Action, AuditEvent, Outcome, system_event
from audit.log import AuditLog, AuditLogSettings
from audit.merkle import hash_leaf
from audit.note import VerifierKey
from audit.self_check import verify_log
from audit.store import AuditReceipt, AuditStore
from audit.tlog_proof import TlogProof

MakeSettings = Callable[..., AuditLogSettings]


def _event(i: int = 0) -> AuditEvent:
    return system_event(
        Action.BOOT_PHASE, time=datetime.now(UTC), outcome=Outcome.SUCCESS, details={"i": i}
    )


def test_concurrent_appends_get_distinct_gap_free_receipts(log_settings: MakeSettings) -> None:
    with AuditLog.open(log_settings()) as log, ThreadPoolExecutor(16) as pool:
        receipts = list(pool.map(lambda i: log.append(_event(i)), range(200)))
        assert sorted(r.index for r in receipts) == list(range(200))
        stored = dict(log.store.entries(0, 199))
        assert all(r.leaf_hash == hash_leaf(stored[r.index]) for r in receipts)


def test_append_async_returns_the_receipt_without_blocking_the_loop(
    log_settings: MakeSettings,
) -> None:
    async def run(log: AuditLog) -> list[int]:
        receipts = await asyncio.gather(*(log.append_async(_event(i)) for i in range(20)))
        return [r.index for r in receipts]

    with AuditLog.open(log_settings()) as log:
        assert sorted(asyncio.run(run(log))) == list(range(20))


def test_an_async_append_whose_waiter_is_cancelled_is_stored_and_the_log_goes_on(
    log_settings: MakeSettings,
) -> None:
    async def run(log: AuditLog) -> int:
        waiters = [asyncio.ensure_future(log.append_async(_event(i))) for i in range(10)]
        await asyncio.sleep(0)  # queued
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return (await log.append_async(_event(10))).index

    with AuditLog.open(log_settings()) as log:
        # The cancelled appends were stored all the same (the writer had them): no gap, and
        # settling their cancelled futures did not stop the writer.
        assert asyncio.run(run(log)) == 10
        assert log.failure is None
        assert log.append(_event(11)).index == 11


def test_checkpoints_every_n_entries_and_on_close(log_settings: MakeSettings) -> None:
    settings = log_settings(every_entries=10, every_s=3600)
    log = AuditLog.open(settings)
    for i in range(25):
        log.append(_event(i))
    deadline = time.monotonic() + 10
    while log.store.latest_checkpoint() is None or log.store.latest_checkpoint().size < 20:
        assert time.monotonic() < deadline, "no checkpoint after 20 entries"
        time.sleep(0.01)
    log.close()
    store_log = AuditLog.open(settings)
    try:
        sizes = [c.size for c in store_log.store.checkpoints(0, 100)]
        assert sizes[-1] == 25  # the final checkpoint at close
        assert all(s >= 10 for s in sizes)
        vkey = VerifierKey.parse(store_log.vkey)
        for stored in store_log.store.checkpoints(0, 100):
            checkpoint = open_checkpoint(stored.note, vkey)
            assert checkpoint.root == store_log.store.root(checkpoint.size)
    finally:
        store_log.close()


def test_checkpoint_after_the_time_limit_even_below_the_count(log_settings: MakeSettings) -> None:
    with AuditLog.open(log_settings(every_entries=1000, every_s=0.2)) as log:
        log.append(_event())
        deadline = time.monotonic() + 10
        while log.store.latest_checkpoint() is None:
            assert time.monotonic() < deadline, "no time-based checkpoint"
            time.sleep(0.02)
        assert log.store.latest_checkpoint().size == 1


def test_an_idle_log_appends_and_signs_heartbeats(log_settings: MakeSettings) -> None:
    with AuditLog.open(log_settings(heartbeat_s=0.2, every_s=0.1)) as log:
        log.append(_event())
        deadline = time.monotonic() + 10
        while log.store.size() < 3:
            assert time.monotonic() < deadline, "no heartbeats while idle"
            time.sleep(0.05)
        entries = [data for _, data in log.store.entries(1, 2)]
        assert all(b'"action":"audit.heartbeat"' in data for data in entries)
        deadline = time.monotonic() + 10
        while (log.store.latest_checkpoint() or None) is None:
            assert time.monotonic() < deadline, "heartbeat not signed"
            time.sleep(0.02)


def test_proof_is_a_tlog_proof_that_verifies_against_the_vkey(log_settings: MakeSettings) -> None:
    with AuditLog.open(log_settings(every_s=3600)) as log:
        receipts = [log.append(_event(i)) for i in range(9)]
        proof = TlogProof.from_text(log.proof(6))  # newer than any checkpoint: one is signed
        checkpoint = proof.verify(receipts[6].leaf_hash, VerifierKey.parse(log.vkey))
        assert checkpoint.size == 9
        with pytest.raises(UnknownEntryError, match="no entry at index 9"):
            log.proof(9)


def test_append_fails_closed_when_the_database_refuses_writes(
    log_settings: MakeSettings, db_url: str
) -> None:
    with AuditLog.open(log_settings()) as log:
        log.append(_event(0))
        engine = create_engine(db_url)
        with engine.begin() as conn:
            if conn.dialect.name == "sqlite":
                conn.execute(text(
                    "CREATE TRIGGER fail_leaves BEFORE INSERT ON audit_leaves "
                    "BEGIN SELECT RAISE(ABORT, 'simulated disk failure'); END"
                ))  # fmt: skip
            else:
                conn.execute(text(
                    "CREATE FUNCTION fail_leaves() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'simulated disk failure'; END $$"
                ))  # fmt: skip
                conn.execute(text(
                    "CREATE TRIGGER fail_leaves BEFORE INSERT ON audit_leaves "
                    "FOR EACH ROW EXECUTE FUNCTION fail_leaves()"
                ))  # fmt: skip
        with pytest.raises(AuditWriteError, match="simulated disk failure"):
            log.append(_event(1))
        with engine.begin() as conn:
            suffix = "" if conn.dialect.name == "sqlite" else " ON audit_leaves"
            conn.execute(text("DROP TRIGGER fail_leaves" + suffix))
        assert log.append(_event(2)).index == 1


def test_a_configured_commitment_key_is_used_instead_of_the_key_dirs(
    log_settings: MakeSettings, tmp_path: Path
) -> None:
    shared = ContentCommitter.load_or_create(tmp_path / "deployment-commitment.key")
    settings = replace(log_settings(), commitment_key_file=tmp_path / "deployment-commitment.key")
    with AuditLog.open(settings) as log:
        assert log.committer.key_id == shared.key_id
    assert not (settings.key_dir / "commitment.key").exists()
    missing = replace(settings, commitment_key_file=tmp_path / "absent.key")
    with pytest.raises(KeyFileError, match=r"absent\.key does not exist"):
        AuditLog.open(missing)


def test_a_writer_that_dies_fails_its_batch_and_every_later_append(
    log_settings: MakeSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with AuditLog.open(log_settings()) as log:
        log.append(_event(0))
        assert log.failure is None

        def crash(events: object) -> object:
            raise RuntimeError("a bug in the writer")

        monkeypatch.setattr(log.store, "append", crash)
        # The append in the writer's hands when it dies fails, rather than waiting forever.
        with pytest.raises(AuditClosedError, match="stopped unexpectedly"):
            log.submit(_event(1)).result(timeout=10)
        assert log.failure == "the audit writer stopped unexpectedly"
        with pytest.raises(AuditWriteError, match="stopped unexpectedly"):
            log.append(_event(2))


def test_append_after_close_raises(log_settings: MakeSettings) -> None:
    log = AuditLog.open(log_settings())
    log.close()
    with pytest.raises(AuditClosedError):
        log.append(_event())


def test_open_refuses_a_database_rolled_back_behind_the_signed_checkpoint(
    log_settings: MakeSettings, tmp_path: Path
) -> None:
    settings = log_settings()
    with AuditLog.open(settings) as log:
        log.append(_event(0))
        log.checkpoint()
        for i in range(3):
            log.append(_event(i))
    # The signer last signed size 4; the same keys now meet an empty database (a restore of
    # an old backup, or a replaced file).
    empty = type(settings)(
        origin=settings.origin,
        database_url=f"sqlite:///{tmp_path / 'restored.db'}",
        key_dir=settings.key_dir,
    )
    with pytest.raises(
        AuditStoreError, match="holds 0 entries but this log signed a checkpoint of 4"
    ):
        AuditLog.open(empty)


def test_open_refuses_a_database_whose_signed_history_was_rewritten(
    log_settings: MakeSettings, tmp_path: Path
) -> None:
    settings = log_settings()
    with AuditLog.open(settings) as log:
        for i in range(4):
            log.append(_event(i))
    forged = type(settings)(
        origin=settings.origin,
        database_url=f"sqlite:///{tmp_path / 'forged.db'}",
        key_dir=settings.key_dir,
    )
    # Same keys, a different history at least as long: the signer's record catches it.
    other = AuditStore.open(forged.database_url, forged.origin)
    other.append([_event(100 + i) for i in range(5)])
    other.close()
    with pytest.raises(AuditStoreError, match="history was rewritten"):
        AuditLog.open(forged)


def test_writer_batches_concurrent_appends_into_few_transactions(
    log_settings: MakeSettings,
) -> None:
    with AuditLog.open(log_settings()) as log:
        calls = []
        real_append = log.store.append

        def counting_append(events: list[AuditEvent]) -> list[AuditReceipt]:
            calls.append(len(events))
            time.sleep(0.01)  # a slow disk: appends pile up meanwhile
            return real_append(events)

        log.store.append = counting_append  # type: ignore[method-assign]
        barrier = threading.Barrier(32)

        def one(i: int) -> int:
            barrier.wait()
            return log.append(_event(i)).index

        with ThreadPoolExecutor(32) as pool:
            indices = list(pool.map(one, range(32)))
        assert sorted(indices) == list(range(32))
        assert len(calls) < 16, f"{len(calls)} transactions for 32 concurrent appends"


def test_self_check_verifies_the_whole_log_and_records_the_outcome(
    log_settings: MakeSettings,
) -> None:
    with AuditLog.open(log_settings()) as log:
        for i in range(5):
            log.append(_event(i))
        report = verify_log(log)
        assert report.num_entries == 6  # five events and the export that verification ran
        [(_, data)] = log.store.entries(6, 6)
        assert b'"action":"audit.verify"' in data
        assert b'"outcome":"success"' in data


def test_self_check_catches_an_entry_edited_behind_the_triggers_back(
    log_settings: MakeSettings, db_url: str
) -> None:
    with AuditLog.open(log_settings()) as log:
        for i in range(4):
            log.append(_event(i))
        log.checkpoint()
        [(_, original)] = log.store.entries(2, 2)
        engine = create_engine(db_url)
        with engine.begin() as conn:
            # What a database owner can do: drop the trigger, edit, and hope nobody checks.
            if conn.dialect.name == "sqlite":
                conn.execute(text("DROP TRIGGER audit_leaves_no_update"))
            else:
                conn.execute(text("DROP TRIGGER audit_leaves_append_only ON audit_leaves"))
            conn.execute(
                text("UPDATE audit_leaves SET entry = :e WHERE origin = :o AND idx = 2"),
                {"e": original.replace(b'"i":2', b'"i":9'), "o": log.origin},
            )
        engine.dispose()
        with pytest.raises(VerificationError, match=r"root mismatch at checkpoints/4\.txt"):
            verify_log(log)
        [(_, data)] = log.store.entries(log.store.size() - 1, log.store.size() - 1)
        assert b'"action":"audit.verify"' in data
        assert b'"outcome":"failure"' in data
