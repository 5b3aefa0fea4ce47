"""The audit log on the request path, against the real server and its real SQLite database:
every /v1 response names its entry, the entry is there (and provable) before the first byte,
requests end with their second entry, prompts and responses never reach the log, and a log that
cannot be written refuses requests without generating anything."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.boot.audit_log import open_audit_log
from appliance.engine.engine import Engine
from audit.commitment import ContentCommitter
from audit.encoding import decode_base64
from audit.export import ExportRequest, export_bundle
from audit.log import COMMITMENT_KEY_FILE, SIGNING_KEY_FILE
from audit.merkle import hash_leaf
from audit.signer import load_note_signer
from tests.appliance.api.conftest import (
    AUDIT_ORIGIN,
    MODEL_NAME,
    RunningServer,
    make_settings,
    running_server,
    wait_until_idle,
    weights_digest,
)

CHAT = "/v1/chat/completions"
SECRET_PROMPT = "The vault combination is zebra-quartz-9131; repeat it back to me."
SECRET_METADATA = "ticket-walrus-4471"


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("audited"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


class AuditDatabase:
    """Reads the server's audit database directly, as an auditor with file access would."""

    def __init__(self, server: RunningServer):
        self.path = server.settings.audit.data_dir / "audit.db"
        key_dir = server.settings.audit.effective_key_dir
        self.vkey = str(load_note_signer(key_dir / SIGNING_KEY_FILE, AUDIT_ORIGIN).verifier)
        self.committer = ContentCommitter.load(key_dir / COMMITMENT_KEY_FILE)

    def _query(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.path) as conn:
            return conn.execute(sql, args).fetchall()

    def raw(self, index: int) -> bytes:
        [(data,)] = self._query(
            "SELECT entry FROM audit_leaves WHERE origin = ? AND idx = ?", AUDIT_ORIGIN, index
        )
        return data

    def entry(self, index: int) -> dict[str, Any]:
        return json.loads(self.raw(index))

    def ending(self, request_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The `inference.complete` entry of a request, waiting for it (an abort is logged
        without the client waiting)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self._query("SELECT entry FROM audit_leaves WHERE origin = ?", AUDIT_ORIGIN)
            for (data,) in rows:
                entry = json.loads(data)
                if entry["request_id"] == request_id and entry["action"] == "inference.complete":
                    return entry
            assert time.monotonic() < deadline, f"no inference.complete for {request_id}"
            time.sleep(0.05)

    def fail_appends(self) -> None:
        """Make every append fail inside the database, as a failing disk would."""
        with sqlite3.connect(self.path) as conn:
            conn.execute(
                "CREATE TRIGGER fail_leaves BEFORE INSERT ON audit_leaves "
                "BEGIN SELECT RAISE(ABORT, 'simulated disk failure'); END"
            )

    def heal(self) -> None:
        with sqlite3.connect(self.path) as conn:
            conn.execute("DROP TRIGGER fail_leaves")


def _entry_header(response: httpx.Response) -> tuple[int, bytes]:
    origin, index, leaf_hash = response.headers["audit-entry"].split(" ")
    assert origin == AUDIT_ORIGIN
    return int(index), decode_base64(leaf_hash, "leaf hash")


def _verify_proof(
    http: httpx.Client, header: str, db: AuditDatabase, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """Fetch the proof of the entry an `Audit-Entry` header names, and verify it offline."""
    _, index, leaf_hash = header.split(" ")
    proof = http.get(f"/v1/audit/proof/{index}")
    assert proof.status_code == 200, proof.text
    assert proof.headers["content-type"].startswith("text/plain")
    assert proof.text.startswith(f"c2sp.org/tlog-proof@v1\nindex {index}\n")
    path = tmp_path / f"proof-{index}.txt"
    path.write_text(proof.text)
    return subprocess.run(
        [sys.executable, "-m", "audit", "verify-proof", str(path), "--vkey", db.vkey,
         "--leaf-hash", leaf_hash],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_a_chat_reply_names_its_accepted_entry_whose_proof_verifies_offline(
    server: RunningServer, http: httpx.Client, tmp_path: Path
) -> None:
    db = AuditDatabase(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0.5,
        "presence_penalty": 0.5,
        "logit_bias": {"42": -1, "43": 2},
        "stop_token_ids": [7],
    }
    # Beyond the integers canonical JSON carries exactly (a fuzzer's find): still logged.
    response = http.post(CHAT, json={**body, "seed": 2**60, "top_k": 10**30})
    assert response.status_code == 200, response.text
    reply = response.json()
    index, leaf_hash = _entry_header(response)
    assert hash_leaf(db.raw(index)) == leaf_hash
    accepted = db.entry(index)
    assert (accepted["action"], accepted["outcome"]) == ("inference.request", "accepted")
    assert accepted["request_id"] == reply["id"]
    # Who sent it, as the bearer token said (the server's local issuer, in these tests).
    assert accepted["actor"] == {
        "issuer": "urn:inferno:local-issuer",
        "subject": "test-user",
        "client": "inferno-token",
        "roles": ["user"],
    }
    assert accepted["source"] == {"address": "127.0.0.1"}
    details = accepted["details"]
    assert details["endpoint"] == CHAT
    assert details["model"] == MODEL_NAME
    assert details["weights_digest"] == weights_digest(server.settings.model.dir)
    assert details["sampling"]["temperature"] == 0.5
    assert details["sampling"]["max_tokens"] == 6
    assert details["sampling"]["seed"] == str(2**60)
    assert details["sampling"]["top_k"] == str(10**30)
    assert details["sampling"]["presence_penalty"] == 0.5
    # Counted, not listed, as the stop strings are.
    assert details["sampling"]["num_logit_bias"] == 2
    assert details["sampling"]["num_stop_token_ids"] == 1
    assert db.committer.matches("prompt", messages, details["prompt_commitment"])

    ending = db.ending(reply["id"])
    assert ending["outcome"] == "success"
    assert ending["details"]["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert ending["details"]["completion_tokens"] == reply["usage"]["completion_tokens"]
    assert ending["details"]["finish_reason"] == reply["choices"][0]["finish_reason"]
    assert ending["details"]["latency_ms"] > 0
    text = reply["choices"][0]["message"]["content"]
    assert db.committer.matches("response", [text], ending["details"]["response_commitment"])

    verified = _verify_proof(http, response.headers["audit-entry"], db, tmp_path)
    assert verified.returncode == 0, verified.stderr
    assert f"OK: entry {index} is in {AUDIT_ORIGIN}" in verified.stdout
    forged = f"{AUDIT_ORIGIN} {index} {'A' * 43}="
    assert _verify_proof(http, forged, db, tmp_path).returncode == 1


def test_a_completion_with_several_choices_commits_to_every_choice_in_order(
    server: RunningServer, http: httpx.Client
) -> None:
    db = AuditDatabase(server)
    body = {"model": MODEL_NAME, "prompt": ["Once", "Twice"], "n": 2, "max_tokens": 3}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    accepted = db.entry(_entry_header(response)[0])
    assert db.committer.matches(
        "prompt", ["Once", "Twice"], accepted["details"]["prompt_commitment"]
    )
    assert accepted["details"]["sampling"]["n"] == 2
    ending = db.ending(reply["id"])
    texts = [choice["text"] for choice in sorted(reply["choices"], key=lambda c: c["index"])]
    assert db.committer.matches("response", texts, ending["details"]["response_commitment"])
    assert ending["details"]["finish_reason"] == "length,length,length,length"


def test_a_stream_is_logged_and_provable_before_its_first_byte_and_ends_before_done(
    server: RunningServer, http: httpx.Client, tmp_path: Path
) -> None:
    db = AuditDatabase(server)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        # Headers received, nothing of the body read: the entry exists and is provable now.
        index, leaf_hash = _entry_header(response)
        assert hash_leaf(db.raw(index)) == leaf_hash
        assert _verify_proof(http, response.headers["audit-entry"], db, tmp_path).returncode == 0
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    request_id = json.loads(lines[0][6:])["id"]
    assert db.entry(index)["request_id"] == request_id
    ending = db.ending(request_id, timeout_s=0)  # stored before [DONE] was sent
    assert ending["outcome"] == "success"
    assert ending["details"]["completion_tokens"] == 12
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert db.committer.matches("response", [text], ending["details"]["response_commitment"])


def test_a_client_that_leaves_a_stream_midway_is_logged_aborted(
    server: RunningServer, http: httpx.Client
) -> None:
    db = AuditDatabase(server)
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: {"))
    request_id = json.loads(first[6:])["id"]
    ending = db.ending(request_id)
    assert ending["outcome"] == "aborted"
    assert 0 < ending["details"]["completion_tokens"] < 400
    wait_until_idle(server.engine)


def test_every_other_api_response_names_an_api_request_entry(
    server: RunningServer, http: httpx.Client
) -> None:
    db = AuditDatabase(server)
    cases = [
        (http.get("/v1/models"), 200, "GET", "/v1/models"),
        (http.get("/v1/models/other"), 404, "GET", "/v1/models/{model_id}"),
        (http.post(CHAT, json={"model": MODEL_NAME}), 400, "POST", CHAT),
        (http.post("/v1/embeddings", json={}), 404, "POST", None),
        (http.get("/v1/audit/proof/999999"), 404, "GET", "/v1/audit/proof/{index}"),
    ]
    for response, status, method, route in cases:
        assert response.status_code == status
        index, leaf_hash = _entry_header(response)
        assert hash_leaf(db.raw(index)) == leaf_hash
        entry = db.entry(index)
        assert entry["action"] == "api.request"
        assert entry["outcome"] == ("success" if status == 200 else "failure")
        assert entry["details"] == {"method": method, "route": route, "status": status}
    assert cases[-1][0].json()["error"]["code"] == "entry_not_found"
    for probe in ("/health", "/live", "/metrics"):
        assert "audit-entry" not in http.get(probe).headers


def test_prompts_replies_and_metadata_never_reach_the_log_bytes(
    server: RunningServer, http: httpx.Client
) -> None:
    chat = http.post(
        CHAT,
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": SECRET_PROMPT}],
              "max_tokens": 24, "temperature": 0, "metadata": {"ticket": SECRET_METADATA}},
    )  # fmt: skip
    completion = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": SECRET_PROMPT, "max_tokens": 24}
    )
    replies = [
        chat.json()["choices"][0]["message"]["content"],
        completion.json()["choices"][0]["text"],
    ]
    db = AuditDatabase(server)
    assert db.ending(chat.json()["id"]) and db.ending(completion.json()["id"])
    stored = b"".join(path.read_bytes() for path in db.path.parent.glob("audit.db*"))
    assert b'"action":"inference.request"' in stored  # the search does see entries
    secrets = ("zebra-quartz-9131", SECRET_PROMPT, SECRET_METADATA)
    for secret in (*secrets, *(r for r in replies if len(r) >= 12)):
        assert secret.encode() not in stored
        assert json.dumps(secret)[1:-1].encode() not in stored


def test_a_log_that_cannot_be_written_refuses_requests_with_503_and_generates_nothing(
    server: RunningServer, http: httpx.Client
) -> None:
    db = AuditDatabase(server)
    wait_until_idle(server.engine)
    queried = server.metric("vllm:prefix_cache_queries_total")
    prompt_tokens = server.metric("vllm:prompt_tokens_total")
    db.fail_appends()
    try:
        refused = [
            http.post(
                CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
            ),
            http.post(
                "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "stream": True}
            ),
            http.get("/v1/models"),
        ]
        for response in refused:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "audit_unavailable"
            assert response.json()["error"]["type"] == "server_error"
            assert "audit-entry" not in response.headers
        assert http.get("/health").status_code == 200
    finally:
        db.heal()
    assert server.metric("vllm:prefix_cache_queries_total") == queried
    assert server.metric("vllm:prompt_tokens_total") == prompt_tokens
    after = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    )
    assert after.status_code == 200
    assert db.ending(after.json()["id"])["outcome"] == "success"


def test_a_stream_whose_end_cannot_be_logged_ends_with_an_error_instead_of_done(
    server: RunningServer, http: httpx.Client
) -> None:
    db = AuditDatabase(server)
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 30, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        db.fail_appends()
        try:
            rest = [line for line in lines if line.startswith("data: ")]
        finally:
            db.heal()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "audit_unavailable"


def test_an_export_beside_the_serving_server_verifies_and_the_server_logs_on(
    server: RunningServer, http: httpx.Client, tmp_path: Path
) -> None:
    db = AuditDatabase(server)
    # What `inferno audit export` does: a second writer of the same log, while the server runs.
    with open_audit_log(server.settings.audit) as log:
        summary = export_bundle(log, tmp_path / "bundle", ExportRequest())
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    after = http.post("/v1/completions", json=body)
    assert after.status_code == 200
    assert _entry_header(after)[0] > summary.export_entry
    verified = subprocess.run(
        [sys.executable, "-m", "audit", "verify", str(summary.path), "--vkey", db.vkey],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert _verify_proof(http, after.headers["audit-entry"], db, tmp_path).returncode == 0
