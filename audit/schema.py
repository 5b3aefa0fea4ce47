"""The audit database's tables, and the triggers that keep them append-only.

Five tables, each keyed by the log's origin so that several appliances can share one PostgreSQL
database, each with its own log:

    audit_logs         one row per log; appenders lock it (SELECT ... FOR UPDATE) to serialize
    audit_leaves       the exact canonical bytes of each entry, at its gap-free position
    audit_nodes        every complete RFC 6962 subtree hash (level 0 = leaf hashes)
    audit_checkpoints  every signed checkpoint, as the exact signed note
    audit_cosignatures the witnesses' cosignature lines on those checkpoints (c2sp.org/
                       tlog-cosignature), one per checkpoint and witness key, added later

Triggers refuse UPDATE, DELETE (and, on PostgreSQL, TRUNCATE) on all five, and refuse an entry
whose position is not the next one. They stop accidents and casual edits; a database owner can
still drop them, which is what the signed checkpoints and the offline verifier are for.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Index,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData()

logs = Table(
    "audit_logs",
    metadata,
    Column("origin", String(255), primary_key=True),
    Column("created", String(32), nullable=False),
)

leaves = Table(
    "audit_leaves",
    metadata,
    Column("origin", String(255), primary_key=True),
    Column("idx", BigInteger, primary_key=True, autoincrement=False),
    Column("time", String(32), nullable=False),
    Column("entry", LargeBinary, nullable=False),
    Index("audit_leaves_by_time", "origin", "time"),
)

nodes = Table(
    "audit_nodes",
    metadata,
    Column("origin", String(255), primary_key=True),
    Column("level", SmallInteger, primary_key=True, autoincrement=False),
    Column("idx", BigInteger, primary_key=True, autoincrement=False),
    Column("hash", LargeBinary(32), nullable=False),
)

checkpoints = Table(
    "audit_checkpoints",
    metadata,
    Column("origin", String(255), primary_key=True),
    Column("size", BigInteger, primary_key=True, autoincrement=False),
    Column("note", Text, nullable=False),
    Column("signed_at", String(32), nullable=False),
)

cosignatures = Table(
    "audit_cosignatures",
    metadata,
    Column("origin", String(255), primary_key=True),
    Column("size", BigInteger, primary_key=True, autoincrement=False),
    Column("witness", String(255), primary_key=True),
    Column("key_id", BigInteger, primary_key=True, autoincrement=False),
    Column("line", Text, nullable=False),
    Column("received_at", String(32), nullable=False),
)

LOG_TABLES = [t.name for t in metadata.sorted_tables]


def _sqlite_triggers() -> list[str]:
    statements = []
    for table in LOG_TABLES:
        for op in ("UPDATE", "DELETE"):
            statements.append(
                f"CREATE TRIGGER IF NOT EXISTS {table}_no_{op.lower()} BEFORE {op} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {op} refused'); END"
            )
    statements.append(
        "CREATE TRIGGER IF NOT EXISTS audit_leaves_gap_free BEFORE INSERT ON audit_leaves "
        "WHEN NEW.idx != COALESCE((SELECT MAX(idx) FROM audit_leaves "
        "WHERE origin = NEW.origin), -1) + 1 "
        "BEGIN SELECT RAISE(ABORT, 'audit_leaves positions must be gap-free'); END"
    )
    return statements


def _postgresql_triggers() -> list[str]:
    statements = [
        "CREATE OR REPLACE FUNCTION audit_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP; END $$",
        "CREATE OR REPLACE FUNCTION audit_leaves_gap_free() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN IF NEW.idx <> COALESCE((SELECT max(idx) FROM audit_leaves "
        "WHERE origin = NEW.origin), -1) + 1 THEN "
        "RAISE EXCEPTION 'audit_leaves positions must be gap-free'; END IF; RETURN NEW; END $$",
        "CREATE OR REPLACE TRIGGER audit_leaves_gap_free BEFORE INSERT ON audit_leaves "
        "FOR EACH ROW EXECUTE FUNCTION audit_leaves_gap_free()",
    ]
    for table in LOG_TABLES:
        statements += [
            f"CREATE OR REPLACE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION audit_refuse_change()",
            f"CREATE OR REPLACE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_refuse_change()",
        ]
    return statements


def create_schema(conn: Connection) -> None:
    """Create the tables and triggers that are missing (idempotent; call inside a transaction)."""
    dialect = conn.dialect.name
    if dialect == "postgresql":
        # Two appliances starting at once against an empty database must not race on DDL.
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('inferno audit schema'))"))
        statements = _postgresql_triggers()
    elif dialect == "sqlite":
        statements = _sqlite_triggers()
    else:
        raise ValueError(f"the audit log supports SQLite and PostgreSQL, not {dialect}")
    metadata.create_all(conn)
    for statement in statements:
        conn.execute(text(statement))
