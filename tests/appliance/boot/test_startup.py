"""The start-up sequence's own steps: the log opens first and records boot.start, or the
appliance refuses to start, saying why without revealing secrets; a re-attestation timer that
crashes stops inference, and one that waits says until when. The gate through the app is
test_boot_gate.py."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from appliance.attestation.service import TeeService
from appliance.boot.audit_events import config_digest
from appliance.boot.audit_log import open_audit_log
from appliance.boot.startup import engine_config, reattest_periodically, start_audit_log
from appliance.config import Settings
from appliance.errors import BootError
from audit.log import SIGNING_KEY_FILE
from tests.appliance.attestation.fake_tee import FakeCollector, FakeVerifier


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


def _settings(model_dir: Path, data_dir: Path, **audit: Any) -> Settings:
    return Settings.model_validate(
        {
            "model": {"dir": str(model_dir)},
            "server": {"insecure_http": True},
            "audit": {"origin": "inferno.test/boot", "data_dir": str(data_dir), **audit},
            "auth": {"local_issuer": "demo", "local_issuer_key_file": str(data_dir / "k.pem")},
            "appliance": {"profile": "development"},
            "tee": {"mode": "insecure-dev"},
        }
    )


def test_the_server_s_engine_captures_its_cuda_graphs_once_ready_while_idle(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """Not during its build: the server is ready without them (W5, docs/BENCHMARKS.md)."""
    config = engine_config(_settings(smollm2_dir, tmp_path))
    assert config.capture_graphs_when_idle


def test_boot_start_is_the_first_entry_with_version_and_config_digest(
    model_dir: Path, tmp_path: Path
) -> None:
    settings = _settings(model_dir, tmp_path / "audit")
    with start_audit_log(settings) as log:
        [(index, data)] = list(log.store.entries(0, 0))
    entry = json.loads(data)
    assert (index, entry["action"], entry["outcome"]) == (0, "boot.start", "success")
    assert entry["details"]["config_digest"] == config_digest(settings)
    assert entry["details"]["software_version"] == importlib.metadata.version("inferno")
    assert os.stat(tmp_path / "audit").st_mode & 0o777 == 0o700


def test_config_digest_changes_with_a_setting_but_never_depends_on_the_password(
    model_dir: Path, tmp_path: Path
) -> None:
    def digest(url: str) -> str:
        return config_digest(_settings(model_dir, tmp_path, database_url=url))

    with_password = digest("postgresql+psycopg://inferno:hunter2@db.example/audit")
    assert with_password == digest("postgresql+psycopg://inferno:other@db.example/audit")
    assert with_password != digest("postgresql+psycopg://inferno:hunter2@db2.example/audit")


def test_a_log_that_cannot_be_opened_stops_the_start_and_hides_the_password(
    model_dir: Path, tmp_path: Path
) -> None:
    url = f"postgresql+psycopg://inferno:hunter2@/audit?host={tmp_path / 'no-server'}"
    with pytest.raises(BootError) as error:
        start_audit_log(_settings(model_dir, tmp_path / "audit", database_url=url))
    message = str(error.value)
    assert message.startswith("the audit log cannot be opened (audit.database_url = ")
    assert "inferno:***@" in message
    assert "hunter2" not in message


def test_a_signing_key_open_to_others_stops_the_start(model_dir: Path, tmp_path: Path) -> None:
    settings = _settings(model_dir, tmp_path / "audit")
    open_audit_log(settings.audit).close()
    os.chmod(tmp_path / "audit" / "keys" / SIGNING_KEY_FILE, 0o644)
    with pytest.raises(BootError, match=r"mode 0644, open to group or others"):
        start_audit_log(settings)


def test_a_reattestation_that_crashes_stops_inference_rather_than_the_timer() -> None:
    class BrokenLog:
        async def append_async(self, event: object) -> None:
            raise RuntimeError("disk on fire")

    reasons: list[str] = []

    async def stop(reason: str) -> None:
        reasons.append(reason)

    tee = TeeService("required", FakeCollector(), FakeVerifier())
    asyncio.run(reattest_periodically(tee, BrokenLog(), 0.01, stop))  # type: ignore[arg-type]
    assert reasons == ["re-attestation failed (RuntimeError); see the server log"]


def test_the_reattestation_timer_says_when_it_runs_next_while_it_waits() -> None:
    now = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    tee = TeeService("required", FakeCollector(), FakeVerifier(), clock=lambda: now)

    async def stop(reason: str) -> None:
        raise AssertionError(reason)

    async def run() -> None:
        timer = asyncio.create_task(reattest_periodically(tee, UnusedLog(), 3600, stop))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert tee.next_reattestation == now + timedelta(hours=1)
        timer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await timer
        assert tee.next_reattestation is None  # no timer, nothing scheduled

    asyncio.run(run())


class UnusedLog:
    async def append_async(self, event: object) -> None:
        raise AssertionError("nothing is re-attested within the test")
