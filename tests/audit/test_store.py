"""The SQL store on real SQLite and real PostgreSQL: positions, bytes, nodes, proofs, triggers."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

from audit.canonical import canonicalize
from audit.errors import AuditWriteError
from audit.event import Action, AuditEvent, Outcome, system_event
from audit.merkle import hash_leaf, root_of, verify_consistency, verify_inclusion
from audit.schema import LOG_TABLES
from audit.store import AuditStore

T0 = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)


@pytest.fixture
def open_store(db_url: str, origin: str) -> Iterator[Callable[[], AuditStore]]:
    """Opens stores on this test's database and log, and closes them after the test."""
    stores: list[AuditStore] = []

    def open_one() -> AuditStore:
        stores.append(AuditStore.open(db_url, origin))
        return stores[-1]

    yield open_one
    for store in stores:
        store.close()


def _event(i: int, time: datetime = T0) -> AuditEvent:
    return system_event(Action.BOOT_PHASE, time=time, outcome=Outcome.SUCCESS, details={"n": i})


def test_append_assigns_gap_free_positions_and_stores_the_hashed_bytes(
    open_store: Callable[[], AuditStore], origin: str
) -> None:
    store = open_store()
    receipts = store.append([_event(i) for i in range(3)]) + store.append([_event(3)])
    assert [r.index for r in receipts] == [0, 1, 2, 3]
    stored = list(store.entries(0, 3))
    for receipt, (index, data) in zip(receipts, stored, strict=True):
        assert receipt.leaf_hash == hash_leaf(data)
        entry = json.loads(data)
        assert entry["index"] == index
        assert canonicalize(entry) == data
    assert receipts[2].header_value().startswith(f"{origin} 2 ")
    assert store.size() == 4


def test_roots_and_proofs_from_stored_nodes_match_the_entries(
    open_store: Callable[[], AuditStore],
) -> None:
    store = open_store()
    for batch in range(7):
        store.append([_event(batch * 5 + i) for i in range(5)])
    leaf_hashes = [hash_leaf(data) for _, data in store.entries(0, 34)]
    for size in (1, 2, 3, 8, 13, 35):
        assert store.root(size) == root_of(leaf_hashes[:size])
    root = store.root(35)
    for index in (0, 17, 34):
        verify_inclusion(index, 35, leaf_hashes[index], store.inclusion_proof(index, 35), root)
    verify_consistency(13, 35, store.consistency_proof(13, 35), store.root(13), root)


def test_two_writers_on_one_log_never_leave_a_gap_or_a_wrong_root(
    open_store: Callable[[], AuditStore],
) -> None:
    first, second = open_store(), open_store()
    errors = []

    def write(store: AuditStore) -> None:
        try:
            for i in range(15):
                store.append([_event(i), _event(i)])
        except Exception as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s,)) for s in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert first.size() == 60
    leaf_hashes = [hash_leaf(data) for _, data in first.entries(0, 59)]
    assert second.root(60) == root_of(leaf_hashes)


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE audit_leaves SET entry = entry WHERE origin = :o",
        "DELETE FROM audit_leaves WHERE origin = :o",
        "UPDATE audit_nodes SET hash = hash WHERE origin = :o",
        "DELETE FROM audit_nodes WHERE origin = :o",
        "UPDATE audit_checkpoints SET note = 'x' WHERE origin = :o",
        "DELETE FROM audit_checkpoints WHERE origin = :o",
        "DELETE FROM audit_logs WHERE origin = :o",
        "UPDATE audit_logs SET created = 'x' WHERE origin = :o",
        "INSERT INTO audit_leaves (origin, idx, time, entry) VALUES (:o, 5, 't', 'x')",
    ],
)
def test_triggers_refuse_changes_to_log_tables(
    db_url: str, origin: str, open_store: Callable[[], AuditStore], statement: str
) -> None:
    store = open_store()
    store.append([_event(0), _event(1)])
    store.add_checkpoint(2, "note", T0)
    engine = create_engine(db_url)
    with pytest.raises(SQLAlchemyError, match=r"append-only|gap-free"), engine.begin() as conn:
        conn.execute(text(statement), {"o": origin})
    assert store.size() == 2


def test_truncate_is_refused_on_postgresql(postgres_server: str, origin: str) -> None:
    store = AuditStore.open(postgres_server, origin)
    store.append([_event(0)])
    store.close()
    engine = create_engine(postgres_server)
    for table in LOG_TABLES:
        with (
            pytest.raises(SQLAlchemyError, match="append-only: TRUNCATE refused"),
            engine.begin() as conn,
        ):
            conn.execute(text(f"TRUNCATE {table} CASCADE"))
    engine.dispose()


def test_a_failed_write_raises_and_the_next_append_continues_without_a_gap(
    db_url: str, open_store: Callable[[], AuditStore]
) -> None:
    store = open_store()
    store.append([_event(0)])
    engine = create_engine(db_url)
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.execute(text(
                "CREATE TRIGGER fail_nodes BEFORE INSERT ON audit_nodes "
                "BEGIN SELECT RAISE(ABORT, 'simulated disk failure'); END"
            ))  # fmt: skip
        else:
            conn.execute(text(
                "CREATE FUNCTION fail_nodes() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'simulated disk failure'; END $$"
            ))  # fmt: skip
            conn.execute(text(
                "CREATE TRIGGER fail_nodes BEFORE INSERT ON audit_nodes "
                "FOR EACH ROW EXECUTE FUNCTION fail_nodes()"
            ))  # fmt: skip
    with pytest.raises(AuditWriteError, match="simulated disk failure"):
        store.append([_event(1), _event(2)])
    with engine.begin() as conn:
        conn.execute(text("DROP TRIGGER fail_nodes" + (
            "" if conn.dialect.name == "sqlite" else " ON audit_nodes")))  # fmt: skip
    assert store.size() == 1
    assert [r.index for r in store.append([_event(1)])] == [1]
    leaf_hashes = [hash_leaf(data) for _, data in store.entries(0, 1)]
    assert store.root(2) == root_of(leaf_hashes)


def test_index_range_selects_entries_by_time(open_store: Callable[[], AuditStore]) -> None:
    store = open_store()
    store.append([_event(i, T0 + timedelta(minutes=i)) for i in range(10)])
    assert store.index_range(T0 + timedelta(minutes=3), T0 + timedelta(minutes=6)) == (3, 6)
    assert store.index_range(None, T0 + timedelta(seconds=30)) == (0, 0)
    assert store.index_range(T0 + timedelta(hours=1), None) is None


def test_checkpoints_are_kept_once_per_size(open_store: Callable[[], AuditStore]) -> None:
    store = open_store()
    store.append([_event(0), _event(1)])
    store.add_checkpoint(1, "one", T0)
    store.add_checkpoint(2, "two", T0)
    store.add_checkpoint(2, "two again", T0)
    assert [c.note for c in store.checkpoints(0, 5)] == ["one", "two"]
    assert store.latest_checkpoint().size == 2


def test_an_unknown_database_scheme_is_refused(origin: str) -> None:
    from audit.errors import AuditStoreError

    with pytest.raises(AuditStoreError, match="sqlite:// or postgresql://, not mysql"):
        AuditStore.open("mysql://localhost/audit", origin)


def test_cosignatures_are_read_back_with_their_checkpoint_once_per_witness_key(
    db_url: str, origin: str, open_store: Callable[[], AuditStore]
) -> None:
    store = open_store()
    store.append([_event(0), _event(1)])
    store.add_checkpoint(1, "one\n\n— log AAAAAAA=\n", T0)
    store.add_checkpoint(2, "two\n\n— log AAAAAAA=\n", T0)
    alpha, beta = "— alpha AAAAAAE=\n", "— beta AAAAAAI=\n"
    store.add_cosignatures(2, [beta, alpha], T0)
    store.add_cosignatures(2, ["— alpha AAAAAAF=\n"], T0)  # the same key again: ignored
    assert [c.note for c in store.checkpoints(0, 5)] == [
        "one\n\n— log AAAAAAA=\n",
        "two\n\n— log AAAAAAA=\n" + alpha + beta,
    ]
    assert store.latest_checkpoint().note.endswith(alpha + beta)  # type: ignore[union-attr]
    with pytest.raises(AuditWriteError, match="no checkpoint of size 3"):
        store.add_cosignatures(3, [alpha], T0)
    engine = create_engine(db_url)
    for statement in ("UPDATE audit_cosignatures SET line = 'x' WHERE origin = :o",
                      "DELETE FROM audit_cosignatures WHERE origin = :o"):  # fmt: skip
        with pytest.raises(SQLAlchemyError, match="append-only"), engine.begin() as conn:
            conn.execute(text(statement), {"o": origin})
