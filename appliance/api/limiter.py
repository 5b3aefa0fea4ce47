"""Per-caller limits on requests, as a pure core: values and `now` in, a decision out.

Each request is charged to several keys at once (its subject, each of its roles; or, for an
attestation, its source address), and each key has a `Budget`: requests in flight, requests in
the last minute, and tokens in the last minute. `admit` admits a request only if every key has
room, and changes nothing when one has not; `release` ends a request and charges its tokens.

Windows slide over the last `WINDOW_S` seconds. A request is admitted while the window's budget
is not yet spent, so the request that spends the last of a token budget may overrun it: its
tokens are known only once it has ended (prompt plus completion, as `release` records them).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

WINDOW_S = 60.0

MAX_TRACKED_KEYS = 10_000
"""Keys with usage kept at once; past it, the least recently used key with nothing in flight is
forgotten (its windows restart empty)."""

LimitName = Literal["max_concurrent_requests", "requests_per_minute", "tokens_per_minute"]


class Key(NamedTuple):
    """What a request is charged to: `kind` is "subject", "role" or "attestation" (whose name
    is a source address)."""

    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class Budget:
    """What one key may use; None is no limit."""

    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class Exceeded:
    """The limit that refused a request: `key`'s `limit`, whose value is `value`.
    `retry_after_s` is None for the concurrency limit: room comes when a request ends."""

    key: Key
    limit: LimitName
    value: int
    retry_after_s: int | None


@dataclass(slots=True)
class _Usage:
    num_in_flight: int = 0
    # Admission times of the requests in the window, oldest first.
    requests: deque[float] = field(default_factory=deque)
    # (end time, tokens) of the requests that ended in the window, oldest first.
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    num_tokens: int = 0

    def expire(self, now: float) -> None:
        start = now - WINDOW_S
        while self.requests and self.requests[0] <= start:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= start:
            self.num_tokens -= self.tokens.popleft()[1]

    @property
    def idle(self) -> bool:
        return not (self.num_in_flight or self.requests or self.tokens)


class Limiter:
    def __init__(self) -> None:
        self._usage: OrderedDict[Key, _Usage] = OrderedDict()

    def admit(self, budgets: Mapping[Key, Budget], now: float) -> Exceeded | None:
        """Admit one request charged to every key of `budgets`; or, changing nothing, return
        the first limit (in the order of `budgets`) that has no room."""
        for key, budget in budgets.items():
            exceeded = self._check(key, budget, now)
            if exceeded is not None:
                return exceeded
        for key in budgets:
            usage = self._touch(key, now)
            usage.num_in_flight += 1
            usage.requests.append(now)
        return None

    def release(self, keys: Iterable[Key], num_tokens: int, now: float) -> None:
        """End a request that `admit` admitted for `keys`, which used `num_tokens`."""
        for key in keys:
            usage = self._touch(key, now)
            # A key forgotten while over MAX_TRACKED_KEYS restarted at zero.
            usage.num_in_flight = max(usage.num_in_flight - 1, 0)
            if num_tokens:
                usage.tokens.append((now, num_tokens))
                usage.num_tokens += num_tokens
            if usage.idle:
                del self._usage[key]

    def num_in_flight(self, key: Key) -> int:
        usage = self._usage.get(key)
        return 0 if usage is None else usage.num_in_flight

    def _check(self, key: Key, budget: Budget, now: float) -> Exceeded | None:
        usage = self._usage.get(key)
        if usage is None:
            usage = _Usage()
        else:
            usage.expire(now)
        limit = budget.max_concurrent_requests
        if limit is not None and usage.num_in_flight >= limit:
            return Exceeded(key, "max_concurrent_requests", limit, None)
        limit = budget.requests_per_minute
        if limit is not None and len(usage.requests) >= limit:
            # Room comes when the request that fills the window leaves it.
            oldest = usage.requests[len(usage.requests) - limit]
            return Exceeded(key, "requests_per_minute", limit, _seconds(oldest + WINDOW_S - now))
        limit = budget.tokens_per_minute
        if limit is not None and usage.num_tokens >= limit:
            return Exceeded(key, "tokens_per_minute", limit, _tokens_free_in(usage, limit, now))
        return None

    def _touch(self, key: Key, now: float) -> _Usage:
        usage = self._usage.pop(key, None)
        if usage is None:
            usage = _Usage()
        usage.expire(now)
        self._usage[key] = usage  # most recently used last
        if len(self._usage) > MAX_TRACKED_KEYS:
            idle = next((k for k, u in self._usage.items() if not u.num_in_flight), None)
            if idle is not None:
                del self._usage[idle]
        return usage


def _tokens_free_in(usage: _Usage, limit: int, now: float) -> int:
    """Seconds until the tokens in the window fall below `limit`."""
    remaining = usage.num_tokens
    for ended, num_tokens in usage.tokens:
        remaining -= num_tokens
        if remaining < limit:
            return _seconds(ended + WINDOW_S - now)
    return 1


def _seconds(delay_s: float) -> int:
    """A delay as Retry-After gives it: whole seconds, at least 1."""
    return max(math.ceil(delay_s), 1)
