"""Searching the audit log: the criteria (pure), and pages of a real log, newest first, with a
bounded scan that says where to continue."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from appliance.console.audit_search import AuditQuery, AuditQueryError, search
from audit.event import Actor, AuditEvent, Outcome
from audit.log import AuditLog, AuditLogSettings

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def entry(**members: object) -> dict[str, object]:
    base = {"action": "api.request", "outcome": "success", "request_id": None,
            "actor": {"subject": "alice"}}  # fmt: skip
    return {**base, **members}


def test_query_parses_the_form_and_ignores_blank_fields() -> None:
    form = {"since": "2026-11-25T12:00", "until": " ", "principal": "alice", "action": "auth.",
            "outcome": "denied", "request_id": ""}  # fmt: skip
    query = AuditQuery.parse(form)
    assert query == AuditQuery(since=T0, principal="alice", action="auth.", outcome=Outcome.DENIED)


@pytest.mark.parametrize(
    ("params", "message"),
    [({"since": "yesterday"}, "since must be a time"), ({"outcome": "maybe"}, "outcome must be")],
)
def test_query_refuses_what_it_cannot_read(params: dict[str, str], message: str) -> None:
    with pytest.raises(AuditQueryError, match=message):
        AuditQuery.parse(params)


def test_criteria_match_subject_action_or_its_prefix_outcome_and_request_id() -> None:
    assert AuditQuery().matches(entry())
    assert AuditQuery(principal="alice").matches(entry())
    assert not AuditQuery(principal="alic").matches(entry())  # exact, not a substring
    assert AuditQuery(action="auth.").matches(entry(action="auth.authorize"))
    assert not AuditQuery(action="auth").matches(entry(action="auth.authorize"))
    assert not AuditQuery(outcome=Outcome.DENIED).matches(entry())
    assert AuditQuery(request_id="r1").matches(entry(request_id="r1"))
    assert not AuditQuery(request_id="r1").matches(entry())


@pytest.fixture
def log(tmp_path: Path) -> AuditLog:
    settings = AuditLogSettings("inferno.test/search", f"sqlite:///{tmp_path / 'a.db'}",
                                tmp_path / "keys")  # fmt: skip
    opened = AuditLog.open(settings)
    for i in range(30):
        actor = Actor(subject="alice" if i % 3 else "bob")
        opened.append(AuditEvent("test.event", Outcome.SUCCESS, T0 + timedelta(minutes=i), actor,
                                 request_id=f"r{i}"))  # fmt: skip
    yield opened
    opened.close()


def test_search_pages_newest_first_and_continues_below_the_last_position(log: AuditLog) -> None:
    query = AuditQuery(principal="bob")
    first = search(log.store, query, None, page_size=4)
    assert [e["request_id"] for e in first.entries] == ["r27", "r24", "r21", "r18"]
    second = search(log.store, query, first.next_before, page_size=4)
    assert [e["request_id"] for e in second.entries] == ["r15", "r12", "r9", "r6"]
    last = search(log.store, query, second.next_before, page_size=4)
    assert [e["request_id"] for e in last.entries] == ["r3", "r0"]
    assert last.next_before is None


def test_search_within_a_time_range(log: AuditLog) -> None:
    query = AuditQuery(since=T0 + timedelta(minutes=10), until=T0 + timedelta(minutes=12))
    found = search(log.store, query, None)
    assert [e["request_id"] for e in found.entries] == ["r12", "r11", "r10"]


def test_search_stops_after_its_scan_budget_and_says_where(log: AuditLog) -> None:
    found = search(log.store, AuditQuery(request_id="r0"), None, max_scanned=10)
    assert found.entries == [] and found.num_scanned == 10
    size = log.store.size()
    assert found.next_before == size - 10
    rest = search(log.store, AuditQuery(request_id="r0"), found.next_before)
    assert [e["request_id"] for e in rest.entries] == ["r0"]
