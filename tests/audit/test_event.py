"""Event schema, commitments and the checkpoint policy."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audit.canonical import JsonValue, canonicalize
from audit.commitment import ContentCommitter
from audit.errors import KeyFileError
from audit.event import (
    Actor,
    AuditEvent,
    Outcome,
    api_request,
    authentication_failure,
    format_time,
    inference_complete,
    inference_request,
    request_limited,
)
from audit.policy import CheckpointPolicy

T = datetime(2025, 3, 1, 9, 30, 15, 120000, tzinfo=timezone(timedelta(hours=2)))
ALICE = Actor(issuer="https://idp.example", subject="alice", client="app", roles=("user", "admin"))


def test_times_are_rfc3339_utc_with_microseconds() -> None:
    assert format_time(T) == "2025-03-01T07:30:15.120000Z"
    with pytest.raises(ValueError, match="timezone-aware"):
        format_time(datetime(2025, 1, 1))


def test_inference_request_entry_holds_who_what_and_a_commitment_never_the_prompt(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    committer = ContentCommitter.load_or_create(tmp_path / "commitment.key")
    prompt = "my secret prompt"
    event = inference_request(
        time=T,
        actor=ALICE,
        source_address="::ffff:10.0.0.7",
        request_id="req-1",
        endpoint="/v1/chat/completions",
        model="smollm2-135m",
        weights_digest="sha256:abcd",
        sampling={"temperature": 0.7, "max_tokens": 64},
        prompt_commitment=committer.commit("prompt", prompt),
    )
    entry = json.loads(canonicalize(event.to_entry(41)))
    assert entry["index"] == 41
    assert entry["action"] == "inference.request"
    assert entry["outcome"] == "accepted"
    assert entry["actor"] == {
        "issuer": "https://idp.example",
        "subject": "alice",
        "client": "app",
        "roles": ["admin", "user"],
    }
    assert entry["source"] == {"address": "10.0.0.7"}
    assert prompt not in canonicalize(entry).decode()
    assert committer.matches("prompt", prompt, entry["details"]["prompt_commitment"])
    assert not committer.matches("response", prompt, entry["details"]["prompt_commitment"])


def test_event_details_are_copied_so_later_changes_cannot_reach_the_log() -> None:
    sampling = {"temperature": 0.5}
    event = inference_request(
        time=T, actor=ALICE, source_address=None, request_id="r", endpoint="/v1/completions",
        model="m", weights_digest="d", sampling=sampling, prompt_commitment="c",
    )  # fmt: skip
    sampling["temperature"] = 2.0
    assert event.to_entry(0)["details"]["sampling"] == {"temperature": 0.5}


def test_inference_complete_refuses_an_accepted_outcome() -> None:
    with pytest.raises(ValueError, match="success, failure or aborted"):
        inference_complete(
            time=T, actor=ALICE, source_address=None, request_id="r", outcome=Outcome.ACCEPTED,
            model="m", weights_digest="d", prompt_tokens=1, completion_tokens=1,
            finish_reason="stop", latency_ms=1.0, prompt_commitment="c", response_commitment="c",
        )  # fmt: skip


def test_an_api_request_records_its_route_and_status_with_the_outcome_they_imply() -> None:
    listing = api_request(
        time=T, actor=ALICE, source_address="10.0.0.7", method="GET", route="/v1/models",
        status=200,
    )  # fmt: skip
    entry = listing.to_entry(3)
    assert (entry["action"], entry["outcome"]) == ("api.request", "success")
    assert entry["details"] == {"method": "GET", "route": "/v1/models", "status": 200}
    refused = api_request(
        time=T, actor=ALICE, source_address=None, method="POST", route=None, status=404
    )
    assert refused.to_entry(4)["outcome"] == "failure"


def test_a_bad_source_address_or_action_is_refused() -> None:
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        authentication_failure(time=T, source_address="evil", request_id=None, reason="expired")


def test_commitments_differ_per_key_and_name_their_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = ContentCommitter.load_or_create(tmp_path / "a.key")
    b = ContentCommitter.load_or_create(tmp_path / "b.key")
    assert a.commit("prompt", "hi") != b.commit("prompt", "hi")
    assert a.commit("prompt", "hi").startswith(f"hmac-sha256:{a.key_id}:")
    assert a.commit("prompt", [{"role": "user", "content": "hi"}]) == a.commit(
        "prompt", b'[{"content":"hi","role":"user"}]'
    )
    assert "key" not in repr(a).replace("key_id", "")
    with pytest.raises(KeyFileError, match="must be 32 bytes"):
        ContentCommitter(b"short")


def test_a_shared_commitment_key_is_loaded_never_created(tmp_path) -> None:  # type: ignore[no-untyped-def]
    made = ContentCommitter.load_or_create(tmp_path / "deployment.key")
    assert ContentCommitter.load(tmp_path / "deployment.key").key_id == made.key_id
    with pytest.raises(KeyFileError, match=r"missing\.key does not exist; copy the deployment"):
        ContentCommitter.load(tmp_path / "missing.key")
    assert not (tmp_path / "missing.key").exists()


def test_policy_checkpoints_by_count_or_age_and_heartbeats_when_idle() -> None:
    policy = CheckpointPolicy(every_entries=10, every_s=5.0, heartbeat_s=3600.0)
    assert not policy.checkpoint_due(num_pending=0, oldest_pending_at=0.0, now=100.0)
    assert policy.checkpoint_due(num_pending=10, oldest_pending_at=99.0, now=100.0)
    assert not policy.checkpoint_due(num_pending=3, oldest_pending_at=99.0, now=100.0)
    assert policy.checkpoint_due(num_pending=3, oldest_pending_at=95.0, now=100.0)
    assert policy.heartbeat_due(last_append_at=0.0, now=3600.0)
    assert not policy.heartbeat_due(last_append_at=1.0, now=3600.0)
    assert policy.seconds_until_due(
        num_pending=2, oldest_pending_at=98.0, last_append_at=99.0, now=100.0
    ) == pytest.approx(3.0)
    assert policy.seconds_until_due(
        num_pending=0, oldest_pending_at=0.0, last_append_at=99.0, now=100.0
    ) == pytest.approx(3599.0)
    with pytest.raises(ValueError, match="positive intervals"):
        CheckpointPolicy(every_entries=0)


_text = st.text(max_size=12)  # any code point but lone surrogates: non-BMP ones included
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    details=st.dictionaries(_text, _json, max_size=5),
    actor=st.builds(
        Actor,
        issuer=st.none() | _text,
        subject=st.none() | _text,
        client=st.none() | _text,
        roles=st.lists(_text, max_size=3),
    ),
    action=st.from_regex(r"[a-z][a-z0-9_]{0,6}(\.[a-z][a-z0-9_]{0,6}){1,3}", fullmatch=True),
    outcome=st.sampled_from(Outcome),
    source=st.none() | st.ip_addresses().map(str),
    request_id=st.none() | _text,
    index=st.integers(0, 2**53 - 1),
)
def test_leaf_bytes_are_the_canonical_entry(
    details: dict[str, JsonValue],
    actor: Actor,
    action: str,
    outcome: Outcome,
    source: str | None,
    request_id: str | None,
    index: int,
) -> None:
    event = AuditEvent(action, outcome, T, actor, source, request_id, details)
    assert event.to_leaf(index) == canonicalize(event.to_entry(index))


def test_a_limited_request_records_the_setting_that_refused_it_as_denied() -> None:
    refused = request_limited(
        time=T, actor=ALICE, source_address="::ffff:10.0.0.7", method="POST",
        route="/v1/chat/completions", limit="limits.subject_requests_per_minute", value=3,
    )  # fmt: skip
    entry = refused.to_entry(5)
    assert (entry["action"], entry["outcome"]) == ("api.limited", "denied")
    assert entry["source"] == {"address": "10.0.0.7"}
    assert entry["details"] == {
        "method": "POST",
        "route": "/v1/chat/completions",
        "limit": "limits.subject_requests_per_minute",
        "value": 3,
    }
