"""SIEM copies: OCSF 1.8 and RFC 5424 lines tie back to the log by origin, index and leaf hash."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from audit.__main__ import main
from audit.canonical import canonicalize
from audit.encoding import encode_base64
from audit.event import (
    Action,
    Actor,
    Outcome,
    api_request,
    authentication_failure,
    inference_complete,
    system_event,
)
from audit.export import ExportRequest, export_bundle
from audit.log import AuditLog, AuditLogSettings
from audit.merkle import hash_leaf
from audit.siem import to_ocsf, to_syslog

T = datetime(2025, 1, 31, 12, 0, 0, 250000, tzinfo=UTC)
ORIGIN = "inferno.test/siem"
ALICE = Actor(issuer="https://idp.example", subject="alice", client="app", roles=("user",))


def _complete() -> bytes:
    event = inference_complete(
        time=T, actor=ALICE, source_address="10.1.2.3", request_id="req-9",
        outcome=Outcome.SUCCESS, model="smollm2", weights_digest="sha256:ab", prompt_tokens=12,
        completion_tokens=30, finish_reason="stop", latency_ms=812.5, prompt_commitment="c",
        response_commitment="r",
    )  # fmt: skip
    return canonicalize(event.to_entry(7))


def test_inference_entry_maps_to_ocsf_api_activity_with_the_ai_operation_profile() -> None:
    data = _complete()
    event = to_ocsf(data, ORIGIN)
    assert (event["class_uid"], event["category_uid"], event["type_uid"]) == (6003, 6, 600301)
    assert event["time"] == 1738324800250
    assert event["metadata"]["version"] == "1.8.0"
    assert event["metadata"]["profiles"] == ["ai_operation"]
    assert event["metadata"]["log_name"] == ORIGIN
    assert event["metadata"]["sequence"] == 7
    assert event["metadata"]["uid"] == encode_base64(hash_leaf(data))
    assert event["ai_model"]["model_name"] == "smollm2"
    assert event["message_context"]["total_tokens"] == 42
    assert event["actor"]["user"]["groups"] == [{"name": "user", "type": "role"}]
    assert event["src_endpoint"] == {"ip": "10.1.2.3"}
    assert event["api"] == {"operation": "inference.complete", "request": {"uid": "req-9"}}
    # The raw entry reproduces the leaf hash the log signed.
    assert hash_leaf(event["raw_data"].encode()) == hash_leaf(data)


def test_authentication_failure_maps_to_ocsf_authentication() -> None:
    data = canonicalize(
        authentication_failure(
            time=T, source_address="10.9.9.9", request_id=None, reason="token expired"
        ).to_entry(3)
    )
    event = to_ocsf(data, ORIGIN)
    assert (event["class_uid"], event["activity_id"], event["type_uid"]) == (3002, 1, 300201)
    assert (event["status_id"], event["status_detail"]) == (2, "failure")
    assert event["user"] == {"name": "unknown"}
    assert event["auth_protocol"] == "OAUTH 2.0"


def test_an_unauthenticated_refused_api_request_maps_to_a_failed_api_activity() -> None:
    data = canonicalize(
        api_request(
            time=T, actor=Actor(), source_address="10.9.9.9", method="POST", route=None, status=404
        ).to_entry(5)
    )
    event = to_ocsf(data, ORIGIN)
    assert (event["class_uid"], event["activity_id"]) == (6003, 99)
    assert (event["status_id"], event["status_detail"]) == (2, "failure")
    assert event["actor"]["user"] == {}
    assert event["api"] == {"operation": "api.request", "request": {"uid": f"{ORIGIN}/5"}}
    assert "ai_model" not in event


def test_syslog_line_is_rfc5424_with_the_entry_as_its_message() -> None:
    data = _complete()
    line = to_syslog(data, 'inferno.test/"odd]', hostname="appliance-1")
    header = re.match(
        r"<(\d+)>1 (\S+) appliance-1 inferno - inference\.complete \[inferno-audit@32473 "
        r'origin="inferno\.test/\\"odd\\]" index="7" leaf="([^"]+)" outcome="success"\] \ufeff',
        line,
    )
    assert header is not None, line
    assert header.group(1) == str(13 * 8 + 6)
    assert header.group(2) == "2025-01-31T12:00:00.250000Z"
    assert header.group(3) == encode_base64(hash_leaf(data))
    assert line[header.end() :].encode() == data


def test_siem_command_prints_one_line_per_verified_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = AuditLogSettings(ORIGIN, f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "keys")
    with AuditLog.open(settings) as log:
        for _ in range(3):
            log.append(system_event(Action.BOOT_PHASE, time=T, outcome=Outcome.SUCCESS, details={}))
        summary = export_bundle(log, tmp_path / "bundle", ExportRequest())
        vkey = log.vkey
    capsys.readouterr()
    assert main(["siem", str(summary.path), "--vkey", vkey, "--format", "ocsf"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["metadata"]["sequence"] for line in lines] == [0, 1, 2, 3]
    (summary.path / "entries.jsonl").write_bytes(b"")
    assert main(["siem", str(summary.path), "--vkey", vkey, "--format", "syslog"]) == 1
    assert capsys.readouterr().out == ""
