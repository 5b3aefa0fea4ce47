"""Whether the server can run inference now, and if not, why: what `/health` reports and what
every inference route checks first.

The server answers before the model is loaded (`/live` at once, `/health` 503 "loading"), so an
orchestrator can tell a slow start from a dead process, and a failed load is reported, not hidden
in a crash loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import Depends, Request

from appliance.api.errors import APIError
from appliance.engine.async_engine import AsyncEngine

Status = Literal["ready", "loading", "failed", "stopped", "draining"]


class Readiness:
    def __init__(self, audit_failure: Callable[[], str | None] = lambda: None) -> None:
        """`audit_failure` says why the audit log refuses all entries, if it does: then nothing
        can be served (every request must be logged first), and health says so at once rather
        than after the first refused request."""
        self._audit_failure = audit_failure
        self._engine: AsyncEngine | None = None
        self._status: Status = "loading"
        self._reason: str | None = "the model is loading"
        self._drained_by: str | None = None

    def set_loading(self, reason: str) -> None:
        """Still starting: `reason` says which step (the TEE gate, the model load)."""
        self._engine = None
        self._status, self._reason = "loading", reason

    def set_ready(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._status, self._reason = "ready", None

    def set_failed(self, reason: str) -> None:
        """Not serving, for `reason` (a closed TEE gate, a failed load or re-attestation): for
        good, until the server restarts."""
        self._engine = None
        self._status, self._reason = "failed", reason

    def set_stopped(self) -> None:
        self._engine = None
        self._status, self._reason = "stopped", "the server is shutting down"

    def drain(self, by: str) -> None:
        """Take no new inference request, for good until restart (an admin's drain, named by
        `by`): requests running go on to their end, and `/health` answers 503 so that load
        balancers send traffic elsewhere."""
        self._drained_by = by

    def state(self) -> tuple[Status, str | None]:
        if (failure := self._audit_failure()) is not None:
            return "failed", f"nothing can be served without the audit log: {failure}"
        if self._engine is not None and not self._engine.is_running:
            return "stopped", "the engine stopped on an error; see the server log"
        if self._drained_by is not None and self._status in ("ready", "loading"):
            return "draining", f"drained by {self._drained_by}; restart the server to serve again"
        return self._status, self._reason

    def engine(self) -> AsyncEngine:
        """The running engine, or the 503 that says why there is none."""
        status, reason = self.state()
        if status != "ready" or self._engine is None:
            raise APIError(503, f"not ready: {reason}", type="server_error", code=status)
        return self._engine


async def _ready_engine(request: Request) -> AsyncEngine:
    readiness: Readiness = request.app.state.readiness
    return readiness.engine()


ReadyEngine = Annotated[AsyncEngine, Depends(_ready_engine)]
