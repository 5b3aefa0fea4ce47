"""A real server for the API tests: uvicorn with TLS on a loopback socket, in a thread, serving
one engine that every test module shares (loading the model once keeps the suite fast), with its
own audit log in a SQLite database."""

from __future__ import annotations

import functools
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from appliance.app import build
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.roles import Role
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel, digest_weights
from appliance.config import Settings, settings_from_mapping
from appliance.engine.engine import Engine
from appliance.server import listen, uvicorn_server

MODEL_NAME = "smollm2"
AUDIT_ORIGIN = "inferno.test/audit"


@pytest.fixture(scope="session")
def api_engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=512, num_kv_blocks=512)


def make_settings(
    directory: Path,
    model_dir: Path,
    *,
    audit: dict[str, Any] | None = None,
    auth: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    limits: dict[str, Any] | None = None,
    **server: Any,
) -> Settings:
    """Settings for a TLS server on a free loopback port, its self-signed certificate, its
    audit log (SQLite) and its local token issuer's key in `directory`; `audit` and `server`
    override those sections, `auth` replaces the `[auth]` section, `engine` and `limits` are
    those sections."""
    return settings_from_mapping(
        {
            "model": {"dir": str(model_dir), "name": MODEL_NAME},
            "engine": engine or {},
            "limits": limits or {},
            "server": {"host": "127.0.0.1", "port": 0, **server},
            "tls": {
                "cert_file": str(directory / "cert.pem"),
                "key_file": str(directory / "key.pem"),
                "self_signed": True,
            },
            "audit": {
                "origin": AUDIT_ORIGIN,
                "data_dir": str(directory / "audit"),
                **(audit or {}),
            },
            "appliance": {"profile": "development"},
            "tee": {"mode": "insecure-dev"},
            "auth": auth
            or {
                "local_issuer": "demo",
                "local_issuer_key_file": str(directory / "auth" / "local-issuer.pem"),
            },
        },
        base_dir=directory,
    )


@functools.cache
def weights_digest(model_dir: Path) -> str:
    """The digest of a model directory's weights, computed once per session (about a second
    for SmolLM2's)."""
    return digest_weights(model_dir)


@dataclass
class RunningServer:
    url: str
    cert_file: Path
    engine: Engine | None
    settings: Settings
    app: FastAPI

    def token(self, role: Role = Role.USER, subject: str = "test-user") -> str:
        """A bearer token of the server's local issuer."""
        issuer = LocalIssuer.from_settings(self.settings.auth)
        assert issuer is not None, "the server's settings have no local issuer"
        return issuer.mint(role, subject, time.time())

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official client with a user's token (its API key), trusting the server's
        certificate; no retries (a 429 or 503 must reach the test)."""
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.token(),
            max_retries=0,
            http_client=httpx.Client(verify=self.tls_context()),
            **kwargs,
        )

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.token(),
            max_retries=0,
            http_client=httpx.AsyncClient(verify=self.tls_context()),
            **kwargs,
        )

    def http(self, role: Role | None = Role.USER, subject: str = "test-user") -> httpx.Client:
        """A client sending a token of `subject` with `role` (none if None)."""
        headers = {} if role is None else {"Authorization": f"Bearer {self.token(role, subject)}"}
        return httpx.Client(
            base_url=self.url, verify=self.tls_context(), timeout=60, headers=headers
        )

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0 when absent, as for a counter never hit)."""
        with self.http(Role.ADMIN) as http:
            text = http.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        return 0.0

    def tls_context(self) -> ssl.SSLContext:
        """Trusts exactly the server's self-signed certificate."""
        return ssl.create_default_context(cafile=self.cert_file)


@contextmanager
def running_server(
    settings: Settings, engine: Engine | None, **build_options: Any
) -> Iterator[RunningServer]:
    """Serve `engine` (or, if None, the model the app loads itself) exactly as `inferno serve`
    does, in a thread; the app closes its audit log when the server stops. `build_options` go
    to `appliance.app.build` (`series_interval_s`)."""
    audit_log = start_audit_log(settings)
    model = None if engine is None else LoadedModel(engine, weights_digest(settings.model.dir))
    app = build(settings, audit_log, model=model, **build_options)
    listener = listen(settings)
    server = uvicorn_server(settings, app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener.sock]})
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    # A given engine is marked ready by a task the app starts, which may run after uvicorn says
    # it started: wait for it, or the first request can find the server still "loading".
    while engine is not None and app.state.readiness.state()[0] != "ready":
        assert time.monotonic() < deadline, "the served engine never became ready"
        time.sleep(0.01)
    try:
        assert settings.tls.cert_file is not None
        yield RunningServer(listener.url, settings.tls.cert_file, engine, settings, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        audit_log.close()


def wait_until_idle(engine: Engine, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until the engine holds no request and every KV block is free."""
    deadline = time.monotonic() + timeout_s
    bm = engine.block_manager
    while engine.has_unfinished() or bm.num_free_blocks != bm.num_blocks:
        assert time.monotonic() < deadline, (
            f"engine not idle: unfinished={engine.has_unfinished()}, "
            f"free blocks {bm.num_free_blocks} of {bm.num_blocks}"
        )
        time.sleep(0.02)


@pytest.fixture(scope="session")
def qwen_template_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's files with Qwen2.5's chat template (both ChatML: the same special tokens),
    which shows tools and parses as Hermes calls."""
    from tests.appliance.api.chat_templates import with_chat_template

    out = tmp_path_factory.mktemp("smollm2-qwen-template")
    return with_chat_template(smollm2_dir, "qwen2_5_instruct.jinja", out)


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("tls"), smollm2_dir)
    with running_server(settings, api_engine) as running:
        yield running
