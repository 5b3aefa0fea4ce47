"""Console sessions, held on the server: the browser's cookie carries only a random id
(`__Host-` prefixed: Secure, Path=/, no Domain; HttpOnly; SameSite=Lax). A session ends after
`idle_timeout_s` without use, after `absolute_timeout_s` in all, or at logout. Each session has
a CSRF token that state-changing console requests must echo (synchronizer token pattern).

Sessions live in this process's memory: a restart logs everyone out, which is the safe side.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from appliance.auth.errors import AuthorizationError
from appliance.auth.key_cache import Clock
from appliance.auth.principal import Principal

SESSION_COOKIE = "__Host-inferno_session"
MAX_SESSIONS = 10_000


@dataclass(slots=True)
class Session:
    id: str
    principal: Principal
    # Kept for RP-initiated logout's id_token_hint; never shown to the browser.
    id_token: str
    csrf_token: str
    created_at: float
    last_seen_at: float

    def verify_csrf(self, submitted: str | None) -> None:
        """Raise `AuthorizationError` unless `submitted` is this session's CSRF token."""
        if submitted is None or not hmac.compare_digest(submitted, self.csrf_token):
            raise AuthorizationError("missing or wrong CSRF token")


class SessionStore:
    def __init__(self, idle_timeout_s: float, absolute_timeout_s: float, clock: Clock) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.absolute_timeout_s = absolute_timeout_s
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def create(self, principal: Principal, id_token: str) -> Session:
        now = self._clock()
        session = Session(
            id=secrets.token_urlsafe(32),
            principal=principal,
            id_token=id_token,
            csrf_token=secrets.token_urlsafe(32),
            created_at=now,
            last_seen_at=now,
        )
        self._sessions[session.id] = session
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)  # the least recently used
        return session

    def get(self, session_id: str) -> Session | None:
        """The live session with this id, now marked used; None (and forgotten) once expired."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        now = self._clock()
        if (
            now - session.last_seen_at > self.idle_timeout_s
            or now - session.created_at > self.absolute_timeout_s
        ):
            del self._sessions[session_id]
            return None
        session.last_seen_at = now
        self._sessions.move_to_end(session_id)
        return session

    def delete(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def cookie(self, session: Session) -> str:
        """The `Set-Cookie` value that hands `session` to the browser."""
        return _cookie(session.id, int(self.absolute_timeout_s))


def expired_cookie() -> str:
    """The `Set-Cookie` value that removes the session cookie."""
    return _cookie("", 0)


def _cookie(value: str, max_age_s: int) -> str:
    return f"{SESSION_COOKIE}={value}; Path=/; Max-Age={max_age_s}; Secure; HttpOnly; SameSite=Lax"
