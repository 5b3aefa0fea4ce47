"""Console sessions in the audit database, on SQLite and on a real PostgreSQL server: random ids
of which only a hash is stored, idle and absolute timeouts, survival across a reopen (a server
restart), revocation, CSRF tokens, and the cookie's attributes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from appliance.auth.errors import AuthorizationError
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import (
    MAX_SESSIONS,
    SESSION_COOKIE,
    SessionStore,
    SessionStoreError,
    expired_cookie,
)

ALICE = Principal("https://idp", "alice", "console", frozenset({Role.ADMIN}), 1234.5)
CAROL = Principal("https://idp", "carol", None, frozenset({Role.AUDITOR}), 99.0)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.db'}"
    url = request.getfixturevalue("postgres_server")
    with create_engine(url).begin() as conn:  # the server is shared by the session's tests
        conn.execute(text("DROP TABLE IF EXISTS console_sessions"))
    return url


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(db_url: str, clock: Clock) -> Iterator[SessionStore]:
    opened = SessionStore.open(db_url, idle_timeout_s=900, absolute_timeout_s=28800, clock=clock)
    yield opened
    opened.close()


def test_session_survives_a_reopen_of_the_database(db_url: str, clock: Clock) -> None:
    first = SessionStore.open(db_url, 900, 28800, clock)
    session = first.create(ALICE, "id.token.x")
    first.close()
    clock.now = 100
    second = SessionStore.open(db_url, 900, 28800, clock)
    found = second.get(session.id)
    second.close()
    assert found is not None
    assert (found.principal, found.id_token, found.csrf_token) == (
        ALICE, "id.token.x", session.csrf_token,
    )  # fmt: skip


def test_database_holds_only_the_hash_of_the_id_and_no_csrf_token(
    store: SessionStore, db_url: str
) -> None:
    session = store.create(CAROL, "id.token.y")
    with create_engine(db_url).connect() as conn:
        rows = conn.execute(text("SELECT * FROM console_sessions")).all()
    stored = " ".join(str(value) for value in rows[0])
    assert session.id not in stored and session.csrf_token not in stored
    assert hashlib.sha256(session.id.encode()).hexdigest() in stored


def test_session_ends_after_the_idle_timeout(store: SessionStore, clock: Clock) -> None:
    session = store.create(ALICE, "id.token.x")
    clock.now = 899
    assert store.get(session.id) is not None  # use renews the idle timeout
    clock.now = 899 + 900
    assert store.get(session.id) is not None
    clock.now += 901
    assert store.get(session.id) is None
    assert store.list_live() == []  # and it is gone


def test_session_ends_at_the_absolute_timeout_however_busy(db_url: str, clock: Clock) -> None:
    store = SessionStore.open(db_url, idle_timeout_s=900, absolute_timeout_s=3600, clock=clock)
    session = store.create(ALICE, "id.token.x")
    while clock.now <= 3600:
        assert store.get(session.id) is not None
        clock.now += 600
    assert store.get(session.id) is None  # at 4200 s, though last used 600 s ago
    store.close()


def test_revoked_session_is_refused_and_listing_shows_only_live_ones(
    store: SessionStore, clock: Clock
) -> None:
    alice, carol = store.create(ALICE, "a"), store.create(CAROL, "c")
    clock.now = 10
    store.get(carol.id)
    listed = store.list_live()
    assert [r.principal.subject for r in listed] == ["carol", "alice"]  # most recent first
    assert store.revoke(listed[1].handle) is True
    assert store.get(alice.id) is None
    assert store.revoke(listed[1].handle) is False
    assert [r.principal.subject for r in store.list_live()] == ["carol"]


def test_logout_deletes_the_session(store: SessionStore) -> None:
    session = store.create(ALICE, "t")
    store.delete(session.id)
    assert store.get(session.id) is None


def test_unknown_or_forged_ids_find_nothing(store: SessionStore) -> None:
    session = store.create(ALICE, "t")
    for forged in ("", "x", session.handle, session.id[:-1], session.id + "A", "é" * 43):
        assert store.get(forged) is None


def test_ids_and_csrf_tokens_are_random_and_distinct(store: SessionStore) -> None:
    sessions = [store.create(ALICE, "t") for _ in range(20)]
    values = {s.id for s in sessions} | {s.csrf_token for s in sessions}
    assert len(values) == 40
    assert all(len(value) >= 43 for value in values)  # 32 random bytes at least


def test_csrf_token_must_match(store: SessionStore) -> None:
    session = store.create(ALICE, "t")
    session.verify_csrf(session.csrf_token)
    for wrong in (None, "", session.csrf_token[:-1], session.id, "é" + session.csrf_token[1:]):
        with pytest.raises(AuthorizationError, match="CSRF"):
            session.verify_csrf(wrong)


def test_cookie_is_host_only_secure_httponly_strict(store: SessionStore) -> None:
    session = store.create(ALICE, "t")
    assert store.cookie(session) == (
        f"{SESSION_COOKIE}={session.id}; Path=/; Max-Age=28800; Secure; HttpOnly; SameSite=Strict"
    )
    assert SESSION_COOKIE.startswith("__Host-")
    assert expired_cookie().startswith(f"{SESSION_COOKIE}=; Path=/; Max-Age=0;")


def test_least_recently_used_sessions_go_past_the_limit(
    store: SessionStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("appliance.auth.sessions.MAX_SESSIONS", 3)
    sessions = []
    for step in range(4):
        clock.now = step
        sessions.append(store.create(ALICE, "t"))
    assert store.get(sessions[0].id) is None
    assert all(store.get(s.id) is not None for s in sessions[1:])
    assert MAX_SESSIONS == 10_000


def test_unreachable_database_raises_session_store_error(tmp_path: Path, clock: Clock) -> None:
    with pytest.raises(SessionStoreError, match="cannot open"):
        SessionStore.open(f"sqlite:///{tmp_path}/missing/dir/audit.db", 900, 3600, clock)


def test_appliances_starting_at_once_on_one_database_all_open_it(db_url: str, clock: Clock) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        stores = list(pool.map(lambda _: SessionStore.open(db_url, 900, 3600, clock), range(8)))
    session = stores[0].create(ALICE, "t")
    assert all(store.get(session.id) is not None for store in stores)
    for store in stores:
        store.close()
