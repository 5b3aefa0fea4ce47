"""Searching the audit log for the console: which entries match a query (pure), and the scan
of the store that finds a page of them, newest first.

The store indexes entries by position and time only, so the other criteria are checked entry
by entry; one page reads at most `max_scanned` entries, and says where it stopped, so a search
over a large log stays bounded and can be continued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from audit.event import Outcome
from audit.store import AuditStore

PAGE_SIZE = 50
MAX_SCANNED = 20_000
_BATCH = 500


class AuditQueryError(ValueError):
    """A search criterion that cannot be read; its message says which and how to write it."""


@dataclass(frozen=True, slots=True)
class AuditQuery:
    """The criteria of a search; None matches anything. `principal` matches an actor's subject
    exactly; `action` an action or, ending in `.`, every action under it (`auth.`)."""

    since: datetime | None = None
    until: datetime | None = None
    principal: str | None = None
    action: str | None = None
    outcome: Outcome | None = None
    request_id: str | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> AuditQuery:
        """The query of the search form's fields (times as `YYYY-MM-DDTHH:MM`, in UTC)."""

        def text(name: str) -> str | None:
            value = params.get(name, "").strip()
            return value or None

        outcome = text("outcome")
        if outcome is not None and outcome not in Outcome.__members__.values():
            raise AuditQueryError(f"outcome must be one of {', '.join(Outcome)}")
        return cls(
            since=_time(text("since"), "since"),
            until=_time(text("until"), "until"),
            principal=text("principal"),
            action=text("action"),
            outcome=None if outcome is None else Outcome(outcome),
            request_id=text("request_id"),
        )

    def matches(self, entry: Mapping[str, Any]) -> bool:
        """Whether a parsed entry meets the criteria other than time (the store filters those)."""
        if self.principal is not None and entry["actor"]["subject"] != self.principal:
            return False
        if self.action is not None:
            action = entry["action"]
            if self.action.endswith("."):
                if not action.startswith(self.action):
                    return False
            elif action != self.action:
                return False
        if self.outcome is not None and entry["outcome"] != self.outcome:
            return False
        return self.request_id is None or entry["request_id"] == self.request_id


def _time(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise AuditQueryError(f"{name} must be a time like 2026-11-25T14:30 (UTC)") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


@dataclass(frozen=True, slots=True)
class AuditPage:
    """Entries matching a query, newest first, and where to continue: `next_before` is the
    position to search below for older ones (None when the range is exhausted)."""

    entries: list[dict[str, Any]]
    next_before: int | None
    num_scanned: int


def search(
    store: AuditStore,
    query: AuditQuery,
    before: int | None,
    *,
    page_size: int = PAGE_SIZE,
    max_scanned: int = MAX_SCANNED,
) -> AuditPage:
    """The newest entries below position `before` (all if None) that match `query`, up to
    `page_size`, reading at most `max_scanned` entries. Raises AuditStoreError."""
    span = store.index_range(query.since, query.until)
    if span is None:
        return AuditPage([], None, 0)
    first, last = span
    if before is not None:
        last = min(last, before - 1)
    found: list[dict[str, Any]] = []
    position, num_scanned = last, 0
    while position >= first and len(found) < page_size and num_scanned < max_scanned:
        low = max(first, position - min(_BATCH, max_scanned - num_scanned) + 1)
        for _, data in reversed(list(store.entries(low, position))):
            num_scanned += 1
            position -= 1
            entry = json.loads(data)
            if query.matches(entry):
                found.append(entry)
                if len(found) == page_size:
                    break
    return AuditPage(found, position + 1 if position >= first else None, num_scanned)
