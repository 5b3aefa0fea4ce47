"""Server-side console sessions: random ids, idle and absolute timeouts, CSRF tokens, and the
cookie's attributes."""

from __future__ import annotations

import pytest

from appliance.auth.errors import AuthorizationError
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE, SessionStore, expired_cookie

ALICE = Principal("https://idp", "alice", "console", frozenset({Role.ADMIN}), 0.0)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_session_ends_after_the_idle_timeout() -> None:
    clock = Clock()
    store = SessionStore(idle_timeout_s=900, absolute_timeout_s=28800, clock=clock)
    session = store.create(ALICE, "id.token.x")
    clock.now = 899
    assert store.get(session.id) is session  # use renews the idle timeout
    clock.now = 899 + 900
    assert store.get(session.id) is session
    clock.now += 901
    assert store.get(session.id) is None
    assert store.get(session.id) is None  # and it is forgotten


def test_session_ends_at_the_absolute_timeout_however_busy() -> None:
    clock = Clock()
    store = SessionStore(idle_timeout_s=900, absolute_timeout_s=3600, clock=clock)
    session = store.create(ALICE, "id.token.x")
    while clock.now <= 3600:
        assert store.get(session.id) is session
        clock.now += 600
    assert store.get(session.id) is None  # at 4200 s, though last used 600 s ago


def test_ids_and_csrf_tokens_are_random_and_distinct() -> None:
    store = SessionStore(900, 3600, Clock())
    sessions = [store.create(ALICE, "t") for _ in range(50)]
    values = {s.id for s in sessions} | {s.csrf_token for s in sessions}
    assert len(values) == 100
    assert all(len(value) >= 43 for value in values)  # 32 random bytes


def test_csrf_token_must_match() -> None:
    session = SessionStore(900, 3600, Clock()).create(ALICE, "t")
    session.verify_csrf(session.csrf_token)
    for wrong in (None, "", session.csrf_token[:-1], session.id):
        with pytest.raises(AuthorizationError, match="CSRF"):
            session.verify_csrf(wrong)


def test_logout_deletes_and_cookies_are_host_only_secure_httponly_lax() -> None:
    store = SessionStore(900, 3600, Clock())
    session = store.create(ALICE, "t")
    cookie = store.cookie(session)
    assert cookie == (
        f"{SESSION_COOKIE}={session.id}; Path=/; Max-Age=3600; Secure; HttpOnly; SameSite=Lax"
    )
    assert SESSION_COOKIE.startswith("__Host-")
    store.delete(session.id)
    assert store.get(session.id) is None
    assert expired_cookie().startswith(f"{SESSION_COOKIE}=; Path=/; Max-Age=0;")
