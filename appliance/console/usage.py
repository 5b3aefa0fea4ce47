"""Usage for the console: requests and tokens per principal and per role over a period, tallied
from the audit log's `inference.complete` entries (never from prompts, which the log does not
hold), and the same rows as CSV.

Each admitted inference request ends in exactly one `inference.complete` entry (success,
failure or aborted), which names its caller (issuer, subject and roles, as the token said) and
its prompt and completion token counts: that entry is one request here. Requests refused before
they were admitted (`api.request`, `api.limited`) generated nothing and are not counted. A
caller holding several roles counts under each of them, so the per-role rows may add up to more
than the total.

The period is bounded (MAX_PERIOD) and so is the scan (MAX_SCANNED entries): a period holding
more entries is refused rather than tallied in part, so a table never undercounts silently.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from audit.event import Action, Outcome
from audit.store import AuditStore

MAX_PERIOD = timedelta(days=31)
MAX_SCANNED = 200_000
DEFAULT_PERIOD = timedelta(days=1)
# A spreadsheet runs a cell starting with one of these as a formula (CSV injection); a subject
# or role comes from the identity provider, so it is not trusted to be plain text.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


class UsageQueryError(ValueError):
    """A period that cannot be read or is too long; its message says which and what to do."""


@dataclass(frozen=True, slots=True)
class UsagePeriod:
    """[since, until], both timezone-aware, at most MAX_PERIOD long."""

    since: datetime
    until: datetime

    @classmethod
    def parse(cls, params: Mapping[str, str], now: datetime) -> UsagePeriod:
        """The period of the form's `since` and `until` (`YYYY-MM-DDTHH:MM`, UTC); a missing
        `until` is the minute after `now`, a missing `since` is DEFAULT_PERIOD before `until`."""
        # The default end is the minute after `now`, so that the form, which shows minutes,
        # names the same period as the page.
        next_minute = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
        until = _time(params.get("until", ""), "until") or next_minute
        since = _time(params.get("since", ""), "since") or until - DEFAULT_PERIOD
        if since >= until:
            raise UsageQueryError("the period's start (since) must come before its end (until)")
        if until - since > MAX_PERIOD:
            raise UsageQueryError(
                f"a period can be at most {MAX_PERIOD.days} days long; choose a shorter one"
            )
        return cls(since, until)

    def form_values(self) -> dict[str, str]:
        """The period as the form's datetime-local fields show it."""
        return {"since": _field(self.since), "until": _field(self.until)}


def _time(value: str, name: str) -> datetime | None:
    value = value.strip()
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise UsageQueryError(f"{name} must be a time like 2026-11-25T14:30 (UTC)") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _field(moment: datetime) -> str:
    moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S" if moment.second else "%Y-%m-%dT%H:%M")


@dataclass(slots=True)
class UsageRow:
    """One principal's or one role's requests and tokens; `name` is the subject or the role,
    `issuer` the subject's issuer (None for a role)."""

    name: str
    issuer: str | None = None
    num_requests: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, entry: Mapping[str, Any]) -> None:
        details = entry["details"]
        self.num_requests += 1
        self.num_failed += entry["outcome"] != Outcome.SUCCESS
        self.prompt_tokens += details["prompt_tokens"]
        self.completion_tokens += details["completion_tokens"]


@dataclass(frozen=True, slots=True)
class Usage:
    """The tally of a period: rows per principal and per role, and how many entries it read."""

    by_principal: list[UsageRow] = field(default_factory=list)
    by_role: list[UsageRow] = field(default_factory=list)
    num_scanned: int = 0

    @property
    def num_requests(self) -> int:
        return sum(row.num_requests for row in self.by_principal)


def tally(entries: Iterable[Mapping[str, Any]]) -> Usage:
    """Usage of the parsed audit entries `entries` (any actions; only `inference.complete`
    counts). Pure."""
    principals: dict[tuple[str | None, str], UsageRow] = {}
    roles: dict[str, UsageRow] = {}
    num_scanned = 0
    for entry in entries:
        num_scanned += 1
        if entry["action"] != Action.INFERENCE_COMPLETE:
            continue
        actor = entry["actor"]
        subject = actor["subject"] or "(unauthenticated)"
        key = (actor["issuer"], subject)
        principals.setdefault(key, UsageRow(subject, actor["issuer"])).add(entry)
        for role in actor["roles"]:
            roles.setdefault(role, UsageRow(role)).add(entry)
    return Usage(list(principals.values()), list(roles.values()), num_scanned)


def read_usage(store: AuditStore, period: UsagePeriod) -> Usage:
    """The usage of the entries timed within `period`. Raises UsageQueryError if the period
    holds more than MAX_SCANNED entries, AuditStoreError if the log cannot be read."""
    span = store.index_range(period.since, period.until)
    if span is None:
        return Usage()
    first, last = span
    num_entries = last - first + 1
    if num_entries > MAX_SCANNED:
        raise UsageQueryError(
            f"that period holds {num_entries} audit entries, more than the {MAX_SCANNED} one "
            "view reads; choose a shorter period"
        )
    return tally(json.loads(data) for _, data in store.entries(first, last))


CSV_COLUMNS = ("group", "name", "issuer", "requests", "failed", "prompt_tokens",
               "completion_tokens", "total_tokens")  # fmt: skip


def to_csv(usage: Usage) -> str:
    """The rows as CSV (RFC 4180): one line per principal, then one per role, every text cell
    neutralised against formula injection."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for group, rows in (("principal", usage.by_principal), ("role", usage.by_role)):
        for row in rows:
            writer.writerow(
                (group, neutralised(row.name), neutralised(row.issuer or ""), row.num_requests,
                 row.num_failed, row.prompt_tokens, row.completion_tokens, row.total_tokens)
            )  # fmt: skip
    return out.getvalue()


def neutralised(cell: str) -> str:
    """`cell` as a spreadsheet shows it as text: prefixed with `'` when it would start a
    formula (OWASP's advice on CSV injection)."""
    return "'" + cell if cell.startswith(_FORMULA_STARTS) else cell


SORT_KEYS: Mapping[str, Callable[[UsageRow], Any]] = {
    "name": lambda r: (r.name, r.issuer or ""),
    "requests": lambda r: r.num_requests,
    "failed": lambda r: r.num_failed,
    "prompt_tokens": lambda r: r.prompt_tokens,
    "completion_tokens": lambda r: r.completion_tokens,
    "total_tokens": lambda r: r.total_tokens,
}
"""The usage table's columns and their sort keys (appliance.console.table)."""
