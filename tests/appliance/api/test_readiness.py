"""Readiness while the model loads and after a load fails: the server answers at once, and
`/health` says why it cannot serve yet. (No module-scoped server here: these tests start their
own, which must not drive the shared engine at the same time as another.)"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, make_settings, running_server


def _wait_for_health(http: httpx.Client, status: str) -> httpx.Response:
    deadline = time.monotonic() + 30
    while (response := http.get("/health")).json()["status"] != status:
        assert time.monotonic() < deadline, response.text
        time.sleep(0.05)
    return response


@pytest.fixture
def slow_load(monkeypatch: pytest.MonkeyPatch, api_engine: Engine) -> Iterator[threading.Event]:
    """Engine loading that waits for the test to release it, then yields the shared engine."""
    release = threading.Event()

    def load(config: object) -> Engine:
        assert release.wait(timeout=30)
        return api_engine

    monkeypatch.setattr(Engine, "from_config", staticmethod(load))
    yield release
    release.set()


def test_health_is_503_loading_until_the_model_is_loaded(
    slow_load: threading.Event, smollm2_dir: Path, tmp_path: Path
) -> None:
    with (
        running_server(make_settings(tmp_path, smollm2_dir), engine=None) as running,
        running.http() as http,
    ):
        response = http.get("/health")
        assert response.status_code == 503
        assert response.json() == {"status": "loading", "reason": "the model is loading"}
        assert http.get("/live").status_code == 200
        refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "loading"
        slow_load.set()
        assert _wait_for_health(http, "ready").status_code == 200
        reply = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        )
        assert reply.status_code == 200


def test_health_is_503_with_the_reason_when_the_model_fails_to_load(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with (
        running_server(make_settings(tmp_path, broken), engine=None) as running,
        running.http() as http,
    ):
        response = _wait_for_health(http, "failed")
        assert response.status_code == 503
        assert "model.safetensors is not a valid safetensors file" in response.json()["reason"]
        assert http.get("/live").status_code == 200
        refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"})
        assert refused.status_code == 503


def test_health_fails_at_once_when_the_audit_log_refuses_all_entries(
    api_engine: Engine, smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        running_server(make_settings(tmp_path, smollm2_dir), api_engine) as running,
        running.http() as http,
    ):
        assert http.get("/health").status_code == 200
        log = running.app.state.audit_trail.log

        def crash(events: object) -> object:
            raise RuntimeError("disk controller gone")

        monkeypatch.setattr(log.store, "append", crash)
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
        first = http.post("/v1/completions", json=body)  # the append that kills the writer
        assert first.status_code == 503
        response = http.get("/health")
        assert response.status_code == 503
        assert response.json()["status"] == "failed"
        assert "audit writer stopped unexpectedly" in response.json()["reason"]
        assert http.post("/v1/completions", json=body).status_code == 503
