"""The HTTP edge of the per-caller limits (`[limits]`, docs/CONFIG.md; the core is
appliance.api.limiter).

An inference request is charged to its subject (issuer and subject together) and to each of its
roles; a `/v1/attestation` request to its source address. A request over a limit is answered 429
with `Retry-After` and a message naming the setting, counted in `inferno:limited_requests`, and
recorded as its own `api.limited` audit entry, which the response names (if that entry cannot be
stored, the answer is 503, as for any request the log cannot record). An admitted inference
request holds its place until it ends, and is then charged the tokens it used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Request

from appliance.api.access import ROUTE_STATE, principal_of
from appliance.api.audit_trail import RECEIPT_STATE, AuditTrail, client_address, request_actor
from appliance.api.errors import APIError
from appliance.api.limiter import Budget, Exceeded, Key, Limiter
from appliance.api.metrics import ServerMetrics
from appliance.auth.principal import Principal
from appliance.config import LimitsSettings
from audit.event import request_limited


class CallerLimits:
    def __init__(
        self,
        settings: LimitsSettings,
        trail: AuditTrail,
        metrics: ServerMetrics,
        *,
        retry_after_s: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._settings = settings
        self._trail = trail
        self._metrics = metrics
        # For a concurrency limit, whose room comes whenever a request ends.
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._limiter = Limiter()

    def budgets(self, principal: Principal) -> dict[Key, Budget]:
        """What an inference request of `principal` is charged to: its subject first, then
        each of its roles; only those with a limit (no limit, nothing to track)."""
        limits = self._settings
        # The issuer too: one subject name may belong to different people at two issuers.
        subject = Key("subject", json.dumps([principal.issuer, principal.subject]))
        budgets = {
            subject: Budget(
                limits.subject_max_concurrent_requests,
                limits.subject_requests_per_minute,
                limits.subject_tokens_per_minute,
            )
        }
        for role in sorted(principal.roles):
            budgets[Key("role", role.value)] = Budget(
                limits.role_max_concurrent_requests.get(role),
                limits.role_requests_per_minute.get(role),
                limits.role_tokens_per_minute.get(role),
            )
        return {key: budget for key, budget in budgets.items() if budget != Budget()}

    async def admit(self, request: Request) -> Charge:
        """Admit an inference request, or raise its 429 once the refusal is recorded."""
        principal = principal_of(request)
        if principal is None:
            # Inference routes need a bearer token (appliance.api.access): a caller nobody
            # authenticated cannot be charged, so it is not served.
            raise RuntimeError("an inference route was reached without an authenticated caller")
        budgets = self.budgets(principal)
        await self._admit(request, budgets)
        return Charge(self, list(budgets))

    async def admit_attestation(self, request: Request) -> None:
        """Count an attestation request against its source address, or raise its 429."""
        per_minute = self._settings.attestation_requests_per_minute
        if per_minute is None:
            return
        key = Key("attestation", client_address(request.scope) or "unknown")
        await self._admit(request, {key: Budget(requests_per_minute=per_minute)})
        self._limiter.release([key], 0, self._clock())  # nothing stays in flight

    async def _admit(self, request: Request, budgets: dict[Key, Budget]) -> None:
        exceeded = self._limiter.admit(budgets, self._clock())
        if exceeded is None:
            return
        setting = f"limits.{exceeded.key.kind}_{exceeded.limit}"
        if exceeded.key.kind == "role":
            setting += f".{exceeded.key.name}"
        self._metrics.count_limited(f"{exceeded.key.kind}_{exceeded.limit}")
        receipt = await self._trail.append(
            request_limited(
                time=datetime.now(UTC),
                actor=request_actor(request.scope),
                source_address=client_address(request.scope),
                method=request.method,
                route=request.scope["state"][ROUTE_STATE],
                limit=setting,
                value=exceeded.value,
            )
        )
        setattr(request.state, RECEIPT_STATE, receipt)
        raise _too_many(exceeded, setting, self._retry_after_s)

    def release(self, keys: list[Key], num_tokens: int) -> None:
        """End a request admitted for `keys` that used `num_tokens` (see `Charge`)."""
        self._limiter.release(keys, num_tokens, self._clock())


def _too_many(exceeded: Exceeded, setting: str, default_retry_after_s: int) -> APIError:
    retry_after_s = exceeded.retry_after_s or default_retry_after_s
    unit = {
        "max_concurrent_requests": "requests in flight",
        "requests_per_minute": "requests per minute",
        "tokens_per_minute": "tokens per minute",
    }[exceeded.limit]
    return APIError(
        429,
        f"over the limit of {exceeded.value} {unit} ({setting}); retry after {retry_after_s} s",
        type="requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


class Charge:
    """An admitted request's place under its limits; `release` ends it (once, however often
    called) and charges the tokens it used."""

    def __init__(self, limits: CallerLimits, keys: list[Key]):
        self._limits = limits
        self._keys = keys

    def release(self, num_tokens: int) -> None:
        if self._keys:
            self._limits.release(self._keys, num_tokens)
            self._keys = []


async def _caller_limits(request: Request) -> CallerLimits:
    return request.app.state.limits


Limits = Annotated[CallerLimits, Depends(_caller_limits)]
