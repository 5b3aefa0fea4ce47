"""Refused requests go to the audit log (and the server log), rate-limited per client address
so that a flood of bad tokens cannot flood the log: each address may have
`events_per_minute` refusals recorded per minute (a token bucket); the refusals past that are
counted, and the next recorded one says how many were left out (`num_suppressed`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Generic, TypeVar

from appliance.auth.errors import AuthenticationError
from appliance.auth.key_cache import Clock
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from audit.event import Actor, AuditEvent, authentication_failure, authorization_denied

logger = logging.getLogger(__name__)

Receipt = TypeVar("Receipt")
AuditHook = Callable[[AuditEvent], Awaitable[Receipt]]
"""Appends an event to the audit log and returns its receipt (raises if it cannot)."""

MAX_TRACKED_SOURCES = 10_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float
    num_suppressed: int = 0


class DenialReporter(Generic[Receipt]):
    """Each method returns the hook's receipt for the recorded event, or None when the event
    was suppressed by the rate limit or could not be recorded."""

    def __init__(self, hook: AuditHook[Receipt], events_per_minute: int, clock: Clock) -> None:
        self._hook = hook
        self._capacity = float(events_per_minute)
        self._per_s = events_per_minute / 60.0
        self._clock = clock
        self._buckets: OrderedDict[str | None, _Bucket] = OrderedDict()

    async def authentication_failed(
        self, error: AuthenticationError, source: str | None, request_id: str | None
    ) -> Receipt | None:
        claimed = Actor(
            issuer=error.claimed.get("issuer"),
            subject=error.claimed.get("subject"),
            client=error.claimed.get("client"),
        )
        event = authentication_failure(
            time=datetime.now(UTC),
            source_address=source,
            request_id=request_id,
            reason=str(error.reason),
            claimed=claimed,
        )
        return await self.report(event, source, f"refused a request from {source}: {error.reason}")

    async def authorization_denied(
        self,
        principal: Principal | None,
        source: str | None,
        request_id: str | None,
        resource: str,
        required: Iterable[Role],
    ) -> Receipt | None:
        """`principal` is None when its roles could not even be read (separation of duties)."""
        event = authorization_denied(
            time=datetime.now(UTC),
            actor=principal.actor() if principal is not None else Actor(),
            source_address=source,
            request_id=request_id,
            resource=resource,
            required_roles=[role.value for role in required],
        )
        who = principal.subject if principal is not None else "a caller"
        return await self.report(event, source, f"denied {resource} to {who} from {source}")

    async def report(self, event: AuditEvent, source: str | None, message: str) -> Receipt | None:
        """Record a refusal `event` from `source` within its budget; `message` goes to the
        server log."""
        num_suppressed = self._take(source)
        if num_suppressed is None:
            return None
        if num_suppressed:
            details = {**event.details, "num_suppressed": num_suppressed}
            event = dataclasses.replace(event, details=details)
            message += f" ({num_suppressed} more not recorded)"
        logger.warning("%s", message)
        try:
            return await self._hook(event)
        except Exception:
            # The request is refused either way; the audit log's own errors say why it failed.
            logger.exception("cannot record a refused request in the audit log")
            return None

    def _take(self, source: str | None) -> int | None:
        """Spend one event of `source`'s budget: the number suppressed before it, or None if
        this one is suppressed too."""
        now = self._clock()
        bucket = self._buckets.pop(source, None)
        if bucket is None:
            bucket = _Bucket(self._capacity, now)
        bucket.tokens = min(self._capacity, bucket.tokens + (now - bucket.updated) * self._per_s)
        bucket.updated = now
        self._buckets[source] = bucket  # most recently used last
        if len(self._buckets) > MAX_TRACKED_SOURCES:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1.0:
            bucket.num_suppressed += 1
            return None
        bucket.tokens -= 1.0
        num_suppressed, bucket.num_suppressed = bucket.num_suppressed, 0
        return num_suppressed
