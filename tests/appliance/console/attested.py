"""An appliance whose TEE is attested (tee.mode "required" over the scripted TEE of
tests/appliance/attestation/fake_tee.py), for the console's tests of what only such an
appliance shows: booted past loading, with a browser session of one principal."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from appliance.app import build
from appliance.attestation.service import TeeService
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE, Session
from appliance.boot.engine_preload import EnginePreload
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from tests.appliance.attestation.fake_tee import FakeCollector, FakeVerifier
from tests.appliance.boot.test_boot_gate import _settings


@contextmanager
def attested_console(
    directory: Path,
    model_dir: Path,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    *,
    role: Role,
    subject: str,
    verifier: FakeVerifier | None = None,
) -> Iterator[tuple[FastAPI, TestClient, Session]]:
    """The app serving `engine` (in place of loading weights), its client carrying the session
    of `subject` with `role`; `verifier` scripts the verdicts (default: every check passes)."""

    def load(config: EngineConfig, *, preload: EnginePreload | None) -> LoadedModel:
        return LoadedModel(engine, "sha256:" + "00" * 32)

    monkeypatch.setattr(LoadedModel, "load", load)
    settings = _settings(directory, model_dir)
    log = start_audit_log(settings)
    tee = TeeService("required", FakeCollector(), verifier or FakeVerifier())
    app = build(settings, log, tee=tee)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        principal = Principal("urn:test", subject, None, frozenset({role}), 0.0)
        session = app.state.sessions.create(principal, "id.token")
        client.cookies.set(SESSION_COOKIE, session.id)
        yield app, client, session
