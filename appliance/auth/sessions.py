"""Console sessions, held in the audit log's database (SQLite or PostgreSQL, `audit.database_url`)
so that they survive a restart, and an admin can list and revoke them.

The browser's cookie (`__Host-` prefixed: Secure, Path=/, no Domain; HttpOnly; SameSite=Strict)
carries a random id of 32 bytes; the database keeps only its SHA-256, so whoever reads the
database (or a backup of it) holds no usable cookie. Each session's CSRF token is derived from
its id (HMAC-SHA256 keyed by the id), so it is not stored either, and only the holder of the
cookie can know it (synchronizer token pattern). A session ends after `idle_timeout_s` without
use, after `absolute_timeout_s` in all, at logout, or when an admin revokes it.

A one-time sign-in ticket (`appliance.auth.console_ticket`) is redeemed into a session once:
its id goes into `console_redeemed_tickets` in the transaction that creates the session.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import (
    Column,
    ColumnElement,
    Connection,
    Engine,
    Float,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.schema import CreateTable

from appliance.auth.errors import AuthError, AuthorizationError
from appliance.auth.key_cache import Clock
from appliance.auth.principal import Principal
from appliance.auth.roles import Role

SESSION_COOKIE = "__Host-inferno_session"
# Past this many live sessions, the least recently used go first: a flood of logins cannot grow
# the table without bound.
MAX_SESSIONS = 10_000
_CSRF_LABEL = b"inferno console csrf"

metadata = MetaData()

console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id_hash", String(64), primary_key=True),
    Column("issuer", Text, nullable=False),
    Column("subject", Text, nullable=False),
    Column("client_id", Text, nullable=True),
    Column("roles", Text, nullable=False),  # space-separated Role values
    Column("token_expires_at", Float, nullable=False),
    # Kept for RP-initiated logout's id_token_hint; never shown to the browser.
    Column("id_token", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("last_seen_at", Float, nullable=False),
)

# The ids of redeemed sign-in tickets, each kept until the ticket could no longer be used.
redeemed_tickets = Table(
    "console_redeemed_tickets",
    metadata,
    Column("ticket_id", String(64), primary_key=True),
    Column("usable_until", Float, nullable=False),
)


class SessionStoreError(AuthError):
    """The session database cannot be read or written: no session is admitted (fail closed)."""


def hash_session_id(session_id: str) -> str:
    """What the database stores of a session id, and the handle an admin revokes it by."""
    return hashlib.sha256(session_id.encode("ascii", "replace")).hexdigest()


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A session as the database holds it: no id, only its hash (`handle`)."""

    handle: str
    principal: Principal
    id_token: str
    created_at: float
    last_seen_at: float


@dataclass(frozen=True, slots=True)
class Session:
    """The session of the browser that sent `id` in its cookie."""

    id: str
    record: SessionRecord

    @property
    def principal(self) -> Principal:
        return self.record.principal

    @property
    def id_token(self) -> str:
        return self.record.id_token

    @property
    def handle(self) -> str:
        return self.record.handle

    @property
    def csrf_token(self) -> str:
        return hmac.new(self.id.encode("ascii"), _CSRF_LABEL, hashlib.sha256).hexdigest()

    def verify_csrf(self, submitted: str | None) -> None:
        """Raise `AuthorizationError` unless `submitted` is this session's CSRF token."""
        if submitted is None or not hmac.compare_digest(
            submitted.encode("utf-8", "replace"), self.csrf_token.encode("ascii")
        ):
            raise AuthorizationError("missing or wrong CSRF token")


class SessionStore:
    """Sessions in the table `console_sessions` of the database `engine` reaches. Every method
    may block on the database: call it from a worker thread in async code. Database failures
    raise `SessionStoreError`, whose message holds no statement parameter."""

    def __init__(
        self, engine: Engine, idle_timeout_s: float, absolute_timeout_s: float, clock: Clock
    ) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.absolute_timeout_s = absolute_timeout_s
        self._engine = engine
        self._clock = clock

    @classmethod
    def open(
        cls, url: str, idle_timeout_s: float, absolute_timeout_s: float, clock: Clock
    ) -> SessionStore:
        """Connect to the database at `url` and create the sessions table if it is missing."""
        try:
            engine = create_engine(url, pool_pre_ping=True, hide_parameters=True)
            if engine.dialect.name == "sqlite":
                # The audit log's writer holds the write lock in bursts: wait for it.
                event.listen(engine, "connect", _sqlite_busy_timeout)
            with engine.begin() as conn:
                # Appliances (or tests) opening one database at once: create_all would check,
                # then create, and all but one would fail. PostgreSQL's IF NOT EXISTS can still
                # collide in its catalog, hence the lock there too.
                if engine.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('inferno sessions'))"))
                conn.execute(CreateTable(console_sessions, if_not_exists=True))
                conn.execute(CreateTable(redeemed_tickets, if_not_exists=True))
        except SQLAlchemyError as exc:
            raise SessionStoreError(f"cannot open the console sessions' database: {exc}") from exc
        return cls(engine, idle_timeout_s, absolute_timeout_s, clock)

    def close(self) -> None:
        self._engine.dispose()

    def create(self, principal: Principal, id_token: str) -> Session:
        """A new session for `principal`; expired sessions and those past MAX_SESSIONS (least
        recently used first) are removed on the way."""
        with self._transaction("create a session") as conn:
            return self._create(conn, principal, id_token, self._clock())

    def redeem(self, ticket_id: str, usable_until: float, principal: Principal) -> Session | None:
        """A new session for `principal` from the sign-in ticket `ticket_id`, or None if that
        ticket was redeemed before (its id is kept until `usable_until`, after which the ticket
        is refused as expired anyway)."""
        now = self._clock()
        try:
            with self._transaction("redeem a sign-in ticket") as conn:
                conn.execute(delete(redeemed_tickets).where(redeemed_tickets.c.usable_until < now))
                conn.execute(
                    redeemed_tickets.insert().values(ticket_id=ticket_id, usable_until=usable_until)
                )
                return self._create(conn, principal, "", now)
        except SessionStoreError as exc:
            if isinstance(exc.__cause__, IntegrityError):  # its id is there: a replay
                return None
            raise

    def _create(self, conn: Connection, principal: Principal, id_token: str, now: float) -> Session:
        session_id = secrets.token_urlsafe(32)
        record = SessionRecord(hash_session_id(session_id), principal, id_token, now, now)
        conn.execute(delete(console_sessions).where(self._expired(now)))
        conn.execute(console_sessions.insert().values(_row(record)))
        excess = conn.execute(select(func.count()).select_from(console_sessions)).scalar_one()
        if excess > MAX_SESSIONS:
            oldest = (
                select(console_sessions.c.id_hash)
                .order_by(console_sessions.c.last_seen_at)
                .limit(excess - MAX_SESSIONS)
            )
            conn.execute(
                delete(console_sessions).where(
                    console_sessions.c.id_hash.in_(oldest.scalar_subquery())
                )
            )
        return Session(session_id, record)

    def get(self, session_id: str) -> Session | None:
        """The live session with this id, now marked used; None (and deleted) once expired."""
        now, handle = self._clock(), hash_session_id(session_id)
        with self._transaction("read a session") as conn:
            row = conn.execute(
                select(console_sessions).where(console_sessions.c.id_hash == handle)
            ).first()
            if row is None:
                return None
            record = _record(row._mapping)
            if self._is_expired(record, now):
                conn.execute(delete(console_sessions).where(console_sessions.c.id_hash == handle))
                return None
            conn.execute(
                update(console_sessions)
                .where(console_sessions.c.id_hash == handle)
                .values(last_seen_at=now)
            )
        return Session(
            session_id,
            SessionRecord(handle, record.principal, record.id_token, record.created_at, now),
        )

    def delete(self, session_id: str) -> None:
        self.revoke(hash_session_id(session_id))

    def revoke(self, handle: str) -> bool:
        """End the session whose id hashes to `handle`; whether there was one."""
        with self._transaction("revoke a session") as conn:
            result = conn.execute(
                delete(console_sessions).where(console_sessions.c.id_hash == handle)
            )
        return result.rowcount > 0

    def list_live(self) -> list[SessionRecord]:
        """Every session not yet expired, most recently used first."""
        now = self._clock()
        with self._transaction("list sessions") as conn:
            rows = conn.execute(
                select(console_sessions)
                .where(~self._expired(now))
                .order_by(console_sessions.c.last_seen_at.desc())
            ).all()
        return [_record(row._mapping) for row in rows]

    def expires_at(self, record: SessionRecord) -> float:
        """When `record` ends unless used again: the earlier of its two timeouts."""
        return min(
            record.last_seen_at + self.idle_timeout_s, record.created_at + self.absolute_timeout_s
        )

    def cookie(self, session: Session) -> str:
        """The `Set-Cookie` value that hands `session` to the browser."""
        return _cookie(session.id, int(self.absolute_timeout_s))

    def _is_expired(self, record: SessionRecord, now: float) -> bool:
        return now > self.expires_at(record)

    def _expired(self, now: float) -> ColumnElement[bool]:
        return or_(
            console_sessions.c.last_seen_at < now - self.idle_timeout_s,
            console_sessions.c.created_at < now - self.absolute_timeout_s,
        )

    @contextmanager
    def _transaction(self, what: str) -> Iterator[Connection]:
        """`engine.begin()`, whose database errors become `SessionStoreError`."""
        try:
            with self._engine.begin() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise SessionStoreError(f"cannot {what}: {type(exc).__name__}") from exc


def _sqlite_busy_timeout(dbapi_connection: object, _record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA busy_timeout = 30000")
    cursor.close()


def _row(record: SessionRecord) -> dict[str, object]:
    principal = record.principal
    return {
        "id_hash": record.handle,
        "issuer": principal.issuer,
        "subject": principal.subject,
        "client_id": principal.client_id,
        "roles": " ".join(sorted(principal.roles)),
        "token_expires_at": principal.expires_at,
        "id_token": record.id_token,
        "created_at": record.created_at,
        "last_seen_at": record.last_seen_at,
    }


def _record(row: object) -> SessionRecord:
    values = dict(row)  # type: ignore[call-overload]
    principal = Principal(
        issuer=values["issuer"],
        subject=values["subject"],
        client_id=values["client_id"],
        roles=frozenset(Role(name) for name in values["roles"].split()),
        expires_at=values["token_expires_at"],
    )
    return SessionRecord(
        values["id_hash"], principal, values["id_token"], values["created_at"],
        values["last_seen_at"],
    )  # fmt: skip


def expired_cookie() -> str:
    """The `Set-Cookie` value that removes the session cookie."""
    return _cookie("", 0)


def _cookie(value: str, max_age_s: int) -> str:
    return (
        f"{SESSION_COOKIE}={value}; Path=/; Max-Age={max_age_s}; Secure; HttpOnly; SameSite=Strict"
    )
