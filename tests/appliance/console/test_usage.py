"""Usage tallied from audit entries (appliance.console.usage): only `inference.complete` counts,
per principal (issuer and subject) and per role, the period's bounds and limits, and CSV whose
cells cannot start a spreadsheet formula."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from appliance.console.usage import (
    MAX_PERIOD,
    UsagePeriod,
    UsageQueryError,
    neutralised,
    tally,
    to_csv,
)

NOW = datetime(2026, 11, 25, 12, 0, 30, tzinfo=UTC)


def complete(subject: str, roles: list[str], prompt: int, completion: int,
             outcome: str = "success", issuer: str = "urn:idp") -> dict[str, Any]:  # fmt: skip
    return {
        "action": "inference.complete",
        "outcome": outcome,
        "actor": {"issuer": issuer, "subject": subject, "client": None, "roles": roles},
        "details": {"prompt_tokens": prompt, "completion_tokens": completion},
    }


def other(action: str) -> dict[str, Any]:
    return {"action": action, "outcome": "accepted",
            "actor": {"issuer": "urn:idp", "subject": "alice", "client": None,
                      "roles": ["user"]}, "details": {}}  # fmt: skip


def test_tally_counts_completed_requests_per_principal_and_per_role() -> None:
    usage = tally([
        other("inference.request"),  # its end is what counts
        complete("alice", ["user"], 10, 5),
        complete("alice", ["user"], 3, 0, outcome="aborted"),
        complete("batch", ["service", "user"], 100, 50),
        complete("alice", ["user"], 1, 1, issuer="urn:other"),  # another IdP's alice
        other("api.request"),
    ])  # fmt: skip
    principals = {(r.issuer, r.name): r for r in usage.by_principal}
    alice = principals[("urn:idp", "alice")]
    assert (alice.num_requests, alice.num_failed, alice.prompt_tokens, alice.completion_tokens,
            alice.total_tokens) == (2, 1, 13, 5, 18)  # fmt: skip
    assert principals[("urn:other", "alice")].num_requests == 1
    roles = {r.name: r for r in usage.by_role}
    assert roles["user"].num_requests == 4  # batch counts under both of its roles
    assert roles["service"].total_tokens == 150
    assert usage.num_requests == 4 and usage.num_scanned == 6


def test_period_defaults_to_the_day_before_the_next_minute() -> None:
    period = UsagePeriod.parse({}, NOW)
    assert period.until == datetime(2026, 11, 25, 12, 1, tzinfo=UTC)
    assert period.since == period.until - timedelta(days=1)
    assert period.form_values() == {"since": "2026-11-24T12:01", "until": "2026-11-25T12:01"}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"since": "yesterday"}, "since must be a time like"),
        ({"until": "2026-13-01T00:00"}, "until must be a time like"),
        ({"since": "2026-11-25T10:00", "until": "2026-11-25T09:00"}, "must come before"),
        ({"since": "2026-01-01T00:00", "until": "2026-11-25T00:00"},
         f"at most {MAX_PERIOD.days} days"),
    ],
)  # fmt: skip
def test_period_refuses_unreadable_reversed_or_too_long_ranges(
    params: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageQueryError, match=message):
        UsagePeriod.parse(params, NOW)


@pytest.mark.parametrize("cell", ["=1+1", "+1", "-1", "@SUM(A1)", "\t=1", "\r=1"])
def test_cells_that_would_start_a_formula_are_neutralised(cell: str) -> None:
    assert neutralised(cell) == "'" + cell


def test_csv_has_a_row_per_principal_and_role_with_hostile_names_neutralised() -> None:
    hostile = '=HYPERLINK("http://x","y")'
    usage = tally([complete(hostile, ["user"], 7, 2), complete("bob", ["@admin"], 1, 1)])
    rows = list(csv.reader(io.StringIO(to_csv(usage))))
    assert rows[0] == ["group", "name", "issuer", "requests", "failed", "prompt_tokens",
                       "completion_tokens", "total_tokens"]  # fmt: skip
    assert rows[1] == ["principal", "'" + hostile, "urn:idp", "1", "0", "7", "2", "9"]
    assert rows[2][:2] == ["principal", "bob"]
    assert [r[:2] for r in rows[3:]] == [["role", "user"], ["role", "'@admin"]]
    assert not any(cell.startswith(("=", "+", "-", "@")) for row in rows for cell in row)
