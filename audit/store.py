"""The audit log's SQL store: entries, tree nodes and checkpoints of one log, via SQLAlchemy.

SQLite (WAL, synchronous=FULL) is the embedded default; PostgreSQL is used by URL. Positions are
assigned under a lock, never by a sequence, so the log has no gaps: on SQLite the write
transaction is `BEGIN IMMEDIATE` (one writer per database), on PostgreSQL the log's row in
`audit_logs` is locked `FOR UPDATE`. Each entry is stored as the exact bytes that were hashed, and
every complete subtree hash is stored with it, so any root or proof costs O(log n) node reads.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, func, select, tuple_
from sqlalchemy.exc import SQLAlchemyError

from audit.encoding import encode_base64
from audit.errors import AuditStoreError, AuditWriteError
from audit.event import AuditEvent, format_time
from audit.merkle import (
    NodeId,
    TreeFrontier,
    consistency_proof_plan,
    fold_right,
    hash_leaf,
    inclusion_proof_plan,
    resolve_plan,
)
from audit.note import parse_signature_line
from audit.schema import checkpoints, cosignatures, create_schema, leaves, logs, nodes

T = TypeVar("T")


@dataclass(frozen=True)
class AuditReceipt:
    """Where an appended entry landed: enough for a client to ask for its inclusion proof."""

    origin: str
    index: int
    leaf_hash: bytes

    def header_value(self) -> str:
        """The `Audit-Entry` response header: `<origin> <index> <base64 leaf hash>`."""
        return f"{self.origin} {self.index} {encode_base64(self.leaf_hash)}"


@dataclass(frozen=True)
class StoredCheckpoint:
    size: int
    note: str
    signed_at: str


def _sqlite_engine(url: str, *, immediate: bool) -> Engine:
    engine = create_engine(url, hide_parameters=True)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        # Let SQLAlchemy's begin below be the only transaction control (the driver's own
        # implicit BEGIN would defer the write lock to the first write).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout = 30000")
        cursor.execute("PRAGMA journal_mode = WAL")
        # FULL: a committed entry survives a power loss, not only a process crash.
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class AuditStore:
    """Entries, nodes and checkpoints of the log `origin` in the database at `url`.

    Appends must come from one thread at a time (the AuditLog's writer); reads may come from any
    thread. Every database failure surfaces as AuditStoreError (AuditWriteError for appends);
    statement parameters (entry bytes) are kept out of those messages.
    """

    def __init__(self, write_engine: Engine, read_engine: Engine, origin: str) -> None:
        self.origin = origin
        self._write_engine = write_engine
        self._read_engine = read_engine
        self._frontier: TreeFrontier | None = None

    @classmethod
    def open(cls, url: str, origin: str) -> AuditStore:
        """Connect, create the schema if missing, and register the log `origin`."""
        try:
            if url.startswith("sqlite"):
                write_engine = _sqlite_engine(url, immediate=True)
                read_engine = _sqlite_engine(url, immediate=False)
            elif url.startswith("postgresql"):
                write_engine = read_engine = create_engine(
                    url, pool_pre_ping=True, hide_parameters=True
                )
            else:
                scheme = url.split(":")[0]
                raise AuditStoreError(
                    f"audit database URL must be sqlite:// or postgresql://, not {scheme}"
                )
            store = cls(write_engine, read_engine, origin)
            with write_engine.begin() as conn:
                create_schema(conn)
                known = conn.execute(select(logs.c.origin).where(logs.c.origin == origin)).first()
                if known is None:
                    created = format_time(datetime.now(UTC))
                    conn.execute(logs.insert().values(origin=origin, created=created))
        except SQLAlchemyError as exc:
            raise AuditStoreError(f"cannot open the audit database: {exc}") from exc
        return store

    def close(self) -> None:
        self._write_engine.dispose()
        self._read_engine.dispose()

    # -- appending -------------------------------------------------------------------------

    def append(self, events: Sequence[AuditEvent]) -> list[AuditReceipt]:
        """Append `events` in one transaction at the next positions; all or none are stored."""
        try:
            with self._write_engine.begin() as conn:
                size = self._lock_and_size(conn)
                frontier = self._frontier
                if frontier is None or frontier.size != size:
                    frontier = self._load_frontier(conn, size)
                leaf_rows, node_rows, receipts = [], [], []
                for offset, audit_event in enumerate(events):
                    index = size + offset
                    data = audit_event.to_leaf(index)
                    completed = frontier.append(hash_leaf(data))
                    leaf_rows.append(
                        {
                            "origin": self.origin,
                            "idx": index,
                            "time": format_time(audit_event.time),
                            "entry": data,
                        }
                    )
                    node_rows += [
                        {"origin": self.origin, "level": n.level, "idx": n.index, "hash": h}
                        for n, h in completed
                    ]
                    receipts.append(AuditReceipt(self.origin, index, completed[0][1]))
                conn.execute(leaves.insert(), leaf_rows)
                conn.execute(nodes.insert(), node_rows)
        except SQLAlchemyError as exc:
            self._frontier = None  # the in-memory tree may be ahead of the database
            raise AuditWriteError(f"audit entries could not be written: {exc}") from exc
        except BaseException:
            self._frontier = None
            raise
        self._frontier = frontier
        return receipts

    def _lock_and_size(self, conn: Connection) -> int:
        if conn.dialect.name == "postgresql":
            locked = conn.execute(
                select(logs.c.origin).where(logs.c.origin == self.origin).with_for_update()
            ).first()
            if locked is None:
                raise AuditWriteError(f"log {self.origin!r} is not registered in the database")
        return self._size(conn)

    def _size(self, conn: Connection) -> int:
        last = conn.execute(
            select(func.max(leaves.c.idx)).where(leaves.c.origin == self.origin)
        ).scalar()
        return 0 if last is None else last + 1

    def _load_frontier(self, conn: Connection, size: int) -> TreeFrontier:
        wanted = TreeFrontier.nodes_for(size)
        found = self._read_nodes(conn, wanted)
        return TreeFrontier(size, [found[n] for n in wanted])

    def add_checkpoint(self, size: int, note: str, signed_at: datetime) -> None:
        """Record a signed checkpoint (a repeat of the latest size is ignored)."""
        try:
            with self._write_engine.begin() as conn:
                exists = conn.execute(
                    select(checkpoints.c.size).where(
                        checkpoints.c.origin == self.origin, checkpoints.c.size == size
                    )
                ).first()
                if exists is None:
                    conn.execute(
                        checkpoints.insert().values(
                            origin=self.origin,
                            size=size,
                            note=note,
                            signed_at=format_time(signed_at),
                        )
                    )
        except SQLAlchemyError as exc:
            raise AuditWriteError(f"checkpoint of size {size} could not be stored: {exc}") from exc

    def add_cosignatures(self, size: int, lines: Sequence[str], received_at: datetime) -> None:
        """Record witness cosignature lines (whole, newline-terminated signature lines) on the
        checkpoint of `size`; a line by a key that already cosigned it is ignored. They are
        stored beside the checkpoint, whose signed note never changes, and read back with it."""
        parsed = [(parse_signature_line(line), line) for line in lines]
        try:
            with self._write_engine.begin() as conn:
                where = (checkpoints.c.origin == self.origin, checkpoints.c.size == size)
                if conn.execute(select(checkpoints.c.size).where(*where)).first() is None:
                    raise AuditWriteError(f"there is no checkpoint of size {size} to cosign")
                known = {
                    (witness, key_id)
                    for witness, key_id in conn.execute(
                        select(cosignatures.c.witness, cosignatures.c.key_id).where(
                            cosignatures.c.origin == self.origin, cosignatures.c.size == size
                        )
                    )
                }
                rows = []
                for signature, line in parsed:
                    if (signature.name, signature.key_id) not in known:
                        known.add((signature.name, signature.key_id))
                        rows.append(
                            {
                                "origin": self.origin,
                                "size": size,
                                "witness": signature.name,
                                "key_id": signature.key_id,
                                "line": line,
                                "received_at": format_time(received_at),
                            }
                        )
                if rows:
                    conn.execute(cosignatures.insert(), rows)
        except SQLAlchemyError as exc:
            raise AuditWriteError(
                f"cosignatures of checkpoint {size} could not be stored: {exc}"
            ) from exc

    # -- reading ---------------------------------------------------------------------------

    def _read(self) -> Connection:
        try:
            return self._read_engine.connect()
        except SQLAlchemyError as exc:
            raise AuditStoreError(f"cannot read the audit database: {exc}") from exc

    def _read_nodes(self, conn: Connection, wanted: Iterable[NodeId]) -> dict[NodeId, bytes]:
        wanted = set(wanted)
        found: dict[NodeId, bytes] = {}
        keys = sorted(wanted)
        for start in range(0, len(keys), 500):  # keep each statement's parameter count small
            chunk = keys[start : start + 500]
            rows = conn.execute(
                select(nodes.c.level, nodes.c.idx, nodes.c.hash).where(
                    nodes.c.origin == self.origin,
                    tuple_(nodes.c.level, nodes.c.idx).in_([tuple(k) for k in chunk]),
                )
            )
            found.update({NodeId(level, idx): value for level, idx, value in rows})
        missing = wanted - found.keys()
        if missing:
            raise AuditStoreError(
                f"audit database lacks tree nodes {sorted(missing)[:3]}: damaged or edited"
            )
        return found

    def _guarded(self, what: str, read: Callable[[Connection], T]) -> T:
        try:
            with self._read() as conn:
                return read(conn)
        except SQLAlchemyError as exc:
            raise AuditStoreError(f"cannot read {what} from the audit database: {exc}") from exc

    def size(self) -> int:
        return self._guarded("the log size", self._size)

    def frontier(self, size: int) -> list[bytes]:
        """The hashes of the perfect subtrees of the first `size` entries, left to right."""
        wanted = TreeFrontier.nodes_for(size)
        found = self._guarded("tree nodes", lambda conn: self._read_nodes(conn, wanted))
        return [found[n] for n in wanted]

    def root(self, size: int) -> bytes:
        """The root of the tree of the first `size` entries."""
        return fold_right(self.frontier(size))

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        plan = inclusion_proof_plan(index, size)
        found = self._guarded(
            "tree nodes", lambda conn: self._read_nodes(conn, (n for e in plan for n in e))
        )
        return resolve_plan(plan, found)

    def consistency_proof(self, size1: int, size2: int) -> list[bytes]:
        plan = consistency_proof_plan(size1, size2)
        found = self._guarded(
            "tree nodes", lambda conn: self._read_nodes(conn, (n for e in plan for n in e))
        )
        return resolve_plan(plan, found)

    def latest_checkpoint(self) -> StoredCheckpoint | None:
        newest = self.recent_checkpoints(None, 1)
        return newest[0] if newest else None

    def checkpoints(self, min_size: int, max_size: int) -> list[StoredCheckpoint]:
        """Every checkpoint with min_size <= size <= max_size, smallest first."""

        def read(conn: Connection) -> list[StoredCheckpoint]:
            rows = conn.execute(
                select(checkpoints.c.size, checkpoints.c.note, checkpoints.c.signed_at)
                .where(
                    checkpoints.c.origin == self.origin,
                    checkpoints.c.size >= min_size,
                    checkpoints.c.size <= max_size,
                )
                .order_by(checkpoints.c.size)
            )
            return self._with_cosignatures(conn, rows)

        return self._guarded("checkpoints", read)

    def recent_checkpoints(self, below: int | None, limit: int) -> list[StoredCheckpoint]:
        """Up to `limit` checkpoints, largest first, each smaller than `below` (if given)."""

        def read(conn: Connection) -> list[StoredCheckpoint]:
            query = select(checkpoints.c.size, checkpoints.c.note, checkpoints.c.signed_at).where(
                checkpoints.c.origin == self.origin
            )
            if below is not None:
                query = query.where(checkpoints.c.size < below)
            rows = conn.execute(query.order_by(checkpoints.c.size.desc()).limit(limit))
            return self._with_cosignatures(conn, rows)

        return self._guarded("checkpoints", read)

    def _with_cosignatures(
        self, conn: Connection, rows: Iterable[tuple[int, str, str]]
    ) -> list[StoredCheckpoint]:
        """Checkpoints with their cosignature lines appended to the log's signed note."""
        found = [tuple(row) for row in rows]
        lines: dict[int, list[str]] = {}
        sizes = [size for size, _, _ in found]
        for start in range(0, len(sizes), 500):  # keep each statement's parameter count small
            for size, line in conn.execute(
                select(cosignatures.c.size, cosignatures.c.line)
                .where(
                    cosignatures.c.origin == self.origin,
                    cosignatures.c.size.in_(sizes[start : start + 500]),
                )
                .order_by(cosignatures.c.size, cosignatures.c.witness, cosignatures.c.key_id)
            ):
                lines.setdefault(size, []).append(line)
        return [
            StoredCheckpoint(size, note + "".join(lines.get(size, [])), signed_at)
            for size, note, signed_at in found
        ]

    def entries(self, first: int, last: int, batch: int = 1000) -> Iterator[tuple[int, bytes]]:
        """The stored bytes of entries first..last (inclusive), in order, read in batches."""
        start = first
        while start <= last:
            end = min(last, start + batch - 1)

            def read(conn: Connection, lo: int = start, hi: int = end) -> list[tuple[int, bytes]]:
                rows = conn.execute(
                    select(leaves.c.idx, leaves.c.entry)
                    .where(leaves.c.origin == self.origin, leaves.c.idx.between(lo, hi))
                    .order_by(leaves.c.idx)
                )
                return [(idx, bytes(entry)) for idx, entry in rows]

            rows = self._guarded("entries", read)
            if [idx for idx, _ in rows] != list(range(start, end + 1)):
                raise AuditStoreError(f"audit database lacks entries between {start} and {end}")
            yield from rows
            start = end + 1

    def index_range(self, since: datetime | None, until: datetime | None) -> tuple[int, int] | None:
        """First and last positions of the entries timed within [since, until], if any."""
        conditions = [leaves.c.origin == self.origin]
        if since is not None:
            conditions.append(leaves.c.time >= format_time(since))
        if until is not None:
            conditions.append(leaves.c.time <= format_time(until))

        def read(conn: Connection) -> tuple[int, int] | None:
            low, high = conn.execute(
                select(func.min(leaves.c.idx), func.max(leaves.c.idx)).where(*conditions)
            ).one()
            return None if low is None else (low, high)

        return self._guarded("entry times", read)
