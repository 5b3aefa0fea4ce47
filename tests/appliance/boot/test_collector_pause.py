"""The cyclic garbage collector through a start (appliance.boot.collector_pause): paused from the
start of `inferno serve`; once the server is ready, the start's objects frozen and the collector
running again; after a start that stopped, however it stopped, running again with nothing
frozen. That the start's large buffers and its data key need no collection to be freed is
tests/appliance/engine/models/test_sealed_images.py and tests/appliance/boot/test_sealed_weights.py.
"""

from __future__ import annotations

import gc
import json
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import appliance.app
import appliance.config
import appliance.server
from appliance.__main__ import main
from appliance.app import build
from appliance.attestation.service import TeeService
from appliance.boot import startup
from appliance.boot.collector_pause import CollectorPause
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel
from appliance.config import Settings
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from attestation.errors import KeyReleaseError
from tests.appliance.attestation.fake_tee import FakeCollector, FakeVerifier
from tests.appliance.boot.test_boot_gate import _settings
from tests.appliance.engine.test_warmup import TINY_LLAMA


@pytest.fixture(autouse=True)
def running_collector() -> Iterator[None]:
    """Each test starts with the collector running and nothing frozen, and leaves it so."""
    gc.enable()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def _garbage_cycle() -> weakref.ref[Cycle]:
    """A reference cycle nothing else refers to: only a collection frees it."""
    return weakref.ref(Cycle())


def test_a_stopped_start_lets_the_collector_run_and_frees_its_cycles_at_once() -> None:
    pause = CollectorPause.begin()
    assert not gc.isenabled()
    cycle = _garbage_cycle()
    pause.stopped()
    assert gc.isenabled()
    assert cycle() is None
    assert gc.get_freeze_count() == 0


def test_ready_freezes_the_start_s_objects_then_collects_only_what_comes_after() -> None:
    pause = CollectorPause.begin()
    state = Cycle()  # alive at ready: start-up state
    cycle = _garbage_cycle()
    pause.ready()
    assert gc.isenabled()
    assert gc.get_freeze_count() > 0
    gc.collect()
    # Frozen: a collection never visits it again. The price (module docstring): a cycle that
    # was already garbage at the freeze is never freed.
    assert cycle() is not None
    later = _garbage_cycle()
    gc.collect()
    assert later() is None
    assert state.me is state


def test_a_collector_that_was_off_stays_off_and_nothing_is_frozen() -> None:
    gc.disable()
    with CollectorPause.begin() as pause:
        pause.ready()
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_a_start_that_never_reached_the_server_ends_its_block_with_the_collector_running() -> None:
    with CollectorPause.begin():
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_serve_pauses_the_collector_from_its_start_and_hands_the_pause_to_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inferno serve` in this process, the app and the server stood in for: the collector is
    off from before the settings are read until the server returns, and the app is given the
    pause to end."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = tmp_path / "inferno.toml"
    config.write_text(
        f'appliance.profile = "development"\n[model]\ndir = "{model_dir}"\n'
        f'[tee]\nmode = "insecure-dev"\n[audit]\norigin = "inferno.test/gc"\n'
        f'data_dir = "{tmp_path / "audit"}"\n[server]\ninsecure_http = true\n'
        f'[auth]\nlocal_issuer = "demo"\nlocal_issuer_key_file = "{tmp_path / "issuer.pem"}"\n'
    )
    seen: dict[str, Any] = {}
    read_settings = appliance.config.load_settings

    def load_settings(*args: Any, **kwargs: Any) -> Settings:
        seen["collector on while the settings are read"] = gc.isenabled()
        return read_settings(*args, **kwargs)

    def stand_in_build(settings: Settings, audit_log: object, **parts: Any) -> str:
        parts["preload"].cancel()  # its thread ends after its imports
        seen["given"] = parts["collector"]
        return "app"

    def stand_in_serve(settings: Settings, app: str, listener: object) -> None:
        seen["collector on while serving"] = gc.isenabled()

    monkeypatch.setattr(appliance.config, "load_settings", load_settings)
    monkeypatch.setattr(appliance.app, "build", stand_in_build)
    monkeypatch.setattr(appliance.server, "listen", lambda settings: None)
    monkeypatch.setattr(appliance.server, "serve", stand_in_serve)
    assert main(["serve", "--config", str(config)]) == 0
    assert isinstance(seen.pop("given"), CollectorPause)
    assert seen == {
        "collector on while the settings are read": False,
        "collector on while serving": False,
    }
    assert gc.isenabled()  # the server returned: the process is ending, nothing was frozen
    assert gc.get_freeze_count() == 0


# ---- through the start-up sequence ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=256, num_kv_blocks=64)


@pytest.fixture
def loads(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the collector was running at each model load (which serves the shared engine)."""
    running: list[bool] = []

    def load(config: EngineConfig, *, preload: object) -> LoadedModel:
        running.append(gc.isenabled())
        return LoadedModel(engine, "sha256:" + "00" * 32)

    monkeypatch.setattr(LoadedModel, "load", load)
    return running


def _start(
    settings: Settings, verifier: FakeVerifier, pause: CollectorPause
) -> Iterator[TestClient]:
    """The app started with `pause`, once its start-up sequence has resumed the collector."""
    log = start_audit_log(settings)
    tee = TeeService("required", FakeCollector(), verifier)
    app = build(settings, log, tee=tee, collector=pause)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while not gc.isenabled():
            assert time.monotonic() < deadline, "the start-up sequence never resumed the collector"
            time.sleep(0.02)
        yield client


def test_the_collector_stays_paused_through_the_load_and_runs_frozen_once_ready(
    tmp_path: Path, smollm2_dir: Path, loads: list[bool]
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    for client in _start(settings, FakeVerifier(), CollectorPause.begin()):
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() > 0
    assert loads == [False]


def test_a_refused_verdict_lets_the_collector_run_with_nothing_frozen(
    tmp_path: Path, smollm2_dir: Path, loads: list[bool]
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    refusing = FakeVerifier(failures={"gpu0.driver_version": "550.54.14 is not allowed"})
    for client in _start(settings, refusing, CollectorPause.begin()):
        assert client.get("/health").json()["status"] == "failed"  # up, saying why
        assert gc.get_freeze_count() == 0
    assert loads == []


def test_a_refused_key_release_lets_the_collector_run_with_nothing_frozen(
    tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(config: EngineConfig, *, preload: object) -> LoadedModel:
        raise KeyReleaseError("the HSM refused to unwrap the data key")

    monkeypatch.setattr(LoadedModel, "load", refused)
    settings = _settings(tmp_path, smollm2_dir)
    for client in _start(settings, FakeVerifier(), CollectorPause.begin()):
        health = client.get("/health").json()
        assert health["status"] == "failed"
        assert "the HSM refused" in health["reason"]
        assert gc.get_freeze_count() == 0


def test_an_unexpected_error_after_boot_ready_fails_the_start_and_lets_the_collector_run(
    tmp_path: Path, smollm2_dir: Path, loads: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception no step expects (here the engine's thread cannot start) stops the start as
    a refusal does: /health says it failed, naming the error's class (never "loading"
    forever), and the collector runs again with nothing frozen."""

    def cannot_start(engine: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(startup.AsyncEngine, "start", cannot_start)
    settings = _settings(tmp_path, smollm2_dir)
    for client in _start(settings, FakeVerifier(), CollectorPause.begin()):
        health = client.get("/health").json()
        assert health["status"] == "failed"
        assert "RuntimeError" in health["reason"]
        assert gc.get_freeze_count() == 0
    assert loads == [False]
