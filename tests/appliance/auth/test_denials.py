"""Refusals reach the audit hook, rate-limited per client address, with the number left out."""

from __future__ import annotations

import asyncio
import logging

import pytest

from appliance.auth.denials import DenialReporter
from appliance.auth.errors import AuthenticationError, Reason
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from audit.event import Action, AuditEvent, Outcome


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_source_gets_its_own_budget_and_suppressed_refusals_are_counted() -> None:
    events: list[AuditEvent] = []
    clock = Clock()

    async def record(event: AuditEvent) -> int:
        events.append(event)
        return len(events) - 1  # the receipt: the entry's index

    async def scenario() -> None:
        reporter = DenialReporter(record, events_per_minute=3, clock=clock)
        error = AuthenticationError(Reason.BAD_SIGNATURE, claimed={"subject": "svc"})
        receipts = [
            await reporter.authentication_failed(error, "192.0.2.1", None) for _ in range(10)
        ]
        assert receipts == [0, 1, 2] + [None] * 7
        await reporter.authentication_failed(error, "192.0.2.2", None)
        clock.now = 20.0  # one more event's worth of budget (3 per minute)
        await reporter.authentication_failed(error, "192.0.2.1", "req-9")

    asyncio.run(scenario())
    first = [e for e in events if e.source_address == "192.0.2.1"]
    assert len(first) == 4
    assert [e.details.get("num_suppressed") for e in first] == [None, None, None, 7]
    assert first[-1].request_id == "req-9"
    assert first[0].actor.subject == "svc"
    assert [e.source_address for e in events].count("192.0.2.2") == 1


def test_authorization_denial_names_the_actor_resource_and_roles() -> None:
    events: list[AuditEvent] = []

    async def record(event: AuditEvent) -> None:
        events.append(event)

    principal = Principal("https://idp", "bob", "console", frozenset({Role.ADMIN}), 0.0)
    reporter = DenialReporter(record, events_per_minute=10, clock=Clock())
    asyncio.run(
        reporter.authorization_denied(principal, "10.0.0.1", "r", "GET /v1/audit", [Role.AUDITOR])
    )
    [event] = events
    assert (event.action, event.outcome) == (Action.AUTHORIZE, Outcome.DENIED)
    assert event.actor.subject == "bob" and list(event.actor.roles) == ["admin"]
    assert event.details == {"resource": "GET /v1/audit", "required_roles": ["auditor"]}


def test_a_failing_audit_hook_is_logged_and_does_not_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(event: AuditEvent) -> None:
        raise OSError("disk full")

    reporter = DenialReporter(broken, events_per_minute=10, clock=Clock())
    with caplog.at_level(logging.ERROR):
        refused = AuthenticationError(Reason.EXPIRED)
        assert asyncio.run(reporter.authentication_failed(refused, None, None)) is None
    assert "cannot record a refused request in the audit log" in caplog.text
