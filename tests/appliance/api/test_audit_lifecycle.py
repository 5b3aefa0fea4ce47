"""The audit log across a server's life: `boot.start` and `boot.ready` first, a failed model
load recorded, and a final checkpoint of every entry when the server stops, on SQLite and on
PostgreSQL. (Each test starts its own server on the shared engine: no module-scoped one here.)"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from appliance.boot.audit_events import config_digest
from appliance.boot.audit_log import audit_log_settings
from appliance.engine.engine import Engine
from audit.store import AuditStore
from tests.appliance.api.conftest import (
    MODEL_NAME,
    make_settings,
    running_server,
    weights_digest,
)


def _stored(settings: Any) -> tuple[list[dict[str, Any]], int | None]:
    """The entries and the latest signed size, read from the database alone (opening the log
    itself would sign any entries left unsigned)."""
    log_settings = audit_log_settings(settings.audit)
    store = AuditStore.open(log_settings.database_url, log_settings.origin)
    try:
        size = store.size()
        entries = [json.loads(data) for _, data in store.entries(0, size - 1)]
        latest = store.latest_checkpoint()
        return entries, None if latest is None else latest.size
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_log_opens_with_boot_entries_and_closes_with_a_checkpoint_of_every_entry(
    api_engine: Engine,
    smollm2_dir: Path,
    tmp_path: Path,
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    audit: dict[str, Any] = {"checkpoint_every_s": 3600, "origin": f"inferno.test/{uuid.uuid4()}"}
    if backend == "postgresql":
        audit["database_url"] = request.getfixturevalue("postgres_server")
    settings = make_settings(tmp_path, smollm2_dir, audit=audit)
    with running_server(settings, api_engine) as running, running.http() as http:
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
    entries, signed_size = _stored(settings)
    assert signed_size == len(entries)  # the final checkpoint, signed as the server stopped
    start, attested, ready, accepted, completed = entries
    assert start["action"] == "boot.start"
    # These settings are insecure-dev: the log says that nothing was attested.
    assert (attested["action"], attested["outcome"]) == ("attestation.verdict", "failure")
    assert attested["details"]["result"] == "skipped"
    assert start["details"]["config_digest"] == config_digest(settings)
    assert start["details"]["software_version"]
    assert ready["action"] == "boot.ready"
    assert ready["details"] == {
        "model": MODEL_NAME,
        "weights_digest": weights_digest(smollm2_dir),
        "model_load_ms": None,  # loaded before the app was built
        "attestation_ms": None,  # insecure-dev: nothing attested
        "load_phases_ms": None,
        "tee": "UNVERIFIED",
    }
    assert [accepted["action"], completed["action"]] == ["inference.request", "inference.complete"]


def test_a_failed_model_load_is_logged_and_nothing_is_served(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    settings = make_settings(tmp_path, broken)
    with running_server(settings, engine=None) as running, running.http() as http:
        deadline = time.monotonic() + 30
        while http.get("/health").json()["status"] != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    entries, _ = _stored(settings)
    assert [e["action"] for e in entries] == ["boot.start", "attestation.verdict", "boot.phase"]
    assert entries[2]["outcome"] == "failure"
    assert entries[2]["details"] == {"phase": "model_load", "error": "ModelLoadError"}
