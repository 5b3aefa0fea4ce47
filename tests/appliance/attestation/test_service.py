"""The TEE service: every way an attestation can go wrong is a failed check of its verdict;
a failure is sticky; a client's attestation never changes the standing verdict."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest

from appliance.attestation.service import AttestationBusyError, TeeService
from appliance.attestation.signing import verify_signed_verdict
from attestation.binding import Channel
from attestation.errors import PolicyError
from tests.appliance.attestation.fake_tee import FakeCollector, FakeVerifier

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _service(collector: FakeCollector, verifier: FakeVerifier) -> TeeService:
    return TeeService("required", collector, verifier, clock=lambda: AT)


def test_required_mode_is_pending_until_a_passing_attestation_then_verified() -> None:
    tee = _service(FakeCollector(), FakeVerifier())
    assert tee.state() == "PENDING"
    attestation = asyncio.run(tee.attest("boot"))
    assert attestation.verdict.trusted
    assert attestation.verdict.at == AT
    assert tee.state() == "VERIFIED"
    assert tee.standing is attestation


def test_a_failed_collection_is_a_failed_check_not_an_exception() -> None:
    tee = _service(FakeCollector(fail_with="GPU 0: CC mode is off"), FakeVerifier())
    attestation = asyncio.run(tee.attest("boot"))
    assert attestation.evidence is None
    assert not attestation.verdict.trusted
    assert attestation.summary() == "collect: GPU 0: CC mode is off"
    assert tee.state() == "FAILED"


@pytest.mark.parametrize(
    ("raises", "detail"),
    [
        (PolicyError("policy file p.toml is empty: an empty policy never passes"), "is empty"),
        (KeyError("boom"), "KeyError; see the server log"),
    ],
)
def test_a_verifier_that_raises_gives_a_failed_verdict(raises: Exception, detail: str) -> None:
    tee = _service(FakeCollector(), FakeVerifier(raises=raises))
    attestation = asyncio.run(tee.attest("boot"))
    [check] = attestation.verdict.checks
    assert (check.name, check.passed) == ("verify", False)
    assert detail in check.detail
    assert tee.state() == "FAILED"


@pytest.mark.parametrize("changed", ["challenge", "channel"])
def test_evidence_for_another_challenge_key_or_channel_fails_before_verification(
    changed: str,
) -> None:
    verifier = FakeVerifier()
    collector = FakeCollector()
    tee = _service(collector, verifier)
    tee.bind_channel(Channel(bytes(32), "inferno.test/log+00000000+AAAA"))
    original = collector.collect

    def replayed(challenge: bytes, public_key: bytes, channel: Channel):  # type: ignore[no-untyped-def]
        if changed == "challenge":
            return original(bytes(32), public_key, channel)
        return original(challenge, public_key, Channel(bytes(range(32)), channel.audit_vkey))

    collector.collect = replayed  # type: ignore[method-assign]
    attestation = asyncio.run(tee.attest("boot"))
    assert attestation.summary() == (
        "collect: the evidence answers another challenge, key or channel"
    )
    assert verifier.verdicts == []


def test_the_header_names_the_standing_verdict_and_its_age() -> None:
    now = [datetime(2026, 11, 26, 4, 0, tzinfo=UTC)]
    tee = TeeService("required", FakeCollector(), FakeVerifier(), clock=lambda: now[0])
    assert tee.attestation_header() == "PENDING"
    assert tee.verdict_in_force() is None
    attestation = asyncio.run(tee.attest("boot"))
    now[0] += timedelta(seconds=42.7)
    assert tee.attestation_header() == f"id={attestation.id}; age=42"
    assert tee.verdict_in_force() == attestation.id
    assert len(attestation.id) == 32
    later = asyncio.run(tee.attest("reattest"))
    assert later.id != attestation.id and tee.verdict_in_force() == later.id
    assert TeeService("insecure-dev", None, None).attestation_header() == "UNVERIFIED"


def test_a_failure_stays_failed_even_if_a_later_attestation_passes() -> None:
    verifier = FakeVerifier()
    tee = _service(FakeCollector(), verifier)
    asyncio.run(tee.attest("boot"))
    verifier.failures = {"gpu0.driver_version": "550.54.14 is not allowed"}
    asyncio.run(tee.attest("reattest"))
    verifier.failures = {}
    later = asyncio.run(tee.attest("reattest"))
    assert later.verdict.trusted
    assert tee.state() == "FAILED"


def test_a_clients_attestation_leaves_the_standing_verdict_alone() -> None:
    verifier = FakeVerifier()
    tee = _service(FakeCollector(), verifier)
    boot = asyncio.run(tee.attest("boot"))
    verifier.failures = {"cpu.report_data": "differs"}
    fresh = asyncio.run(tee.attest_for_client(bytes(range(32))))
    assert not fresh.verdict.trusted
    assert fresh.challenge == bytes(range(32))
    assert (tee.state(), tee.standing) == ("VERIFIED", boot)


def test_the_signed_statement_names_challenge_evidence_key_and_verdict() -> None:
    verifier = FakeVerifier(failures={"gpu0.dev_tools": "dev-tools mode is on"})
    tee = _service(FakeCollector(), verifier)
    attestation = asyncio.run(tee.attest_for_client(bytes(range(32))))
    statement = verify_signed_verdict(tee.signed_statement(attestation))
    assert statement["challenge"] == bytes(range(32)).hex()
    assert statement["attestation_public_key"] == tee.key.public_bytes.hex()
    assert attestation.evidence is not None
    assert statement["evidence_digest"] == attestation.evidence.digest()
    assert statement["report_data"] == attestation.evidence.report_data.hex()
    assert statement["verdict"]["result"] == "not trusted"
    assert statement["verdict"]["failed"] == [
        {"name": "gpu0.dev_tools", "passed": False, "detail": "dev-tools mode is on"}
    ]


def test_insecure_dev_is_unverified_and_attests_nothing() -> None:
    tee = TeeService("insecure-dev", None, None)
    assert tee.state() == "UNVERIFIED"
    with pytest.raises(RuntimeError, match="insecure-dev"):
        asyncio.run(tee.attest("boot"))


def test_required_mode_needs_a_collector_and_a_verifier() -> None:
    with pytest.raises(ValueError, match="needs an evidence collector"):
        TeeService("required", None, FakeVerifier())


def test_a_client_asking_while_a_collection_runs_is_turned_away_not_queued() -> None:
    started, release = threading.Event(), threading.Event()
    verifier = FakeVerifier(on_verify=lambda evidence: (started.set(), release.wait(10)))
    tee = _service(FakeCollector(), verifier)

    async def scenario() -> None:
        first = asyncio.create_task(tee.attest_for_client(bytes(32)))
        await asyncio.to_thread(started.wait, 10)
        with pytest.raises(AttestationBusyError, match="retry shortly"):
            await tee.attest_for_client(bytes(32))
        release.set()
        assert (await first).verdict.trusted

    asyncio.run(scenario())
