"""The boot gate in the app (ARCHITECTURE.md, "Start-up", steps 1, 3, 4 and 8), with a scripted
TEE (tests/appliance/attestation/fake_tee.py): no weight loads before a passing verdict, a
closed gate says why everywhere (/health, /v1/attestation, the header, the audit log), and a
failed re-attestation stops inference. The same gate over synthetic devices and the real
verifiers, with a sealed model, is tests/e2e/test_boot_gate.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from appliance.app import build
from appliance.attestation.service import TeeService
from appliance.attestation.signing import verify_signed_verdict
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.roles import Role
from appliance.boot import cuda_driver, startup
from appliance.boot.audit_log import open_audit_log
from appliance.boot.engine_preload import EnginePreload
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel
from appliance.config import Settings, settings_from_mapping
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import EngineConfigError, TensorParallelError
from appliance.errors import BootError, ConfigError
from attestation.errors import CollectionError
from tests.appliance.attestation.fake_tee import FakeCollector, FakeVerifier

NONCE = "5a" * 32


@pytest.fixture(scope="module")
def engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=256, num_kv_blocks=64)


def _settings(directory: Path, model_dir: Path, **tee: Any) -> Settings:
    return settings_from_mapping(
        {
            "model": {"dir": str(model_dir), "name": "smollm2"},
            "server": {"insecure_http": True},
            "audit": {"origin": "inferno.test/gate", "data_dir": str(directory / "audit")},
            "auth": {"local_issuer": "demo", "local_issuer_key_file": "issuer.pem"},
            "appliance": {"profile": "development"},
            "tee": {
                "mode": "required",
                "policy_file": "policy.toml",
                "gpu_rims_dir": "rims",
                **tee,
            },
        },
        base_dir=directory,
    )


class LoadSpy:
    """Stands in for LoadedModel.load: records each call and the preload it was given, waits
    for that preload as the real load does before the engine's first step, serves the shared
    engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.num_calls = 0
        self.preloads: list[EnginePreload | None] = []

    def __call__(self, config: EngineConfig, *, preload: EnginePreload | None) -> LoadedModel:
        self.num_calls += 1
        self.preloads.append(preload)
        if preload is not None:
            preload.wait()
        return LoadedModel(self.engine, "sha256:" + "00" * 32)


@pytest.fixture
def load_spy(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> LoadSpy:
    spy = LoadSpy(engine)
    monkeypatch.setattr(LoadedModel, "load", spy)
    return spy


def _serve(
    settings: Settings, tee: TeeService, preload: EnginePreload | None = None
) -> Iterator[TestClient]:
    log = start_audit_log(settings)
    app = build(settings, log, tee=tee, preload=preload)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline, "the start-up sequence never ended"
            time.sleep(0.02)
        yield client


def _token(settings: Settings) -> dict[str, str]:
    issuer = LocalIssuer.from_settings(settings.auth)
    assert issuer is not None
    return {"Authorization": f"Bearer {issuer.mint(Role.USER, 'gate-test', time.time())}"}


def _chat(client: TestClient, settings: Settings) -> Any:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return client.post("/v1/chat/completions", json=body, headers=_token(settings))


def _entries(settings: Settings) -> list[dict[str, Any]]:
    with open_audit_log(settings.audit) as log:
        return [json.loads(leaf) for _, leaf in log.store.entries(0, log.store.size() - 1)]


def _actions(entries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    boot = ("boot.", "attestation.")
    return [(e["action"], e["outcome"]) for e in entries if e["action"].startswith(boot)]


def test_a_passing_verdict_loads_the_model_then_serves_verified(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    collector = FakeCollector()
    tee = TeeService("required", collector, FakeVerifier())
    for client in _serve(settings, tee):
        health = client.get("/health")
        assert (health.status_code, health.headers["x-inferno-tee"]) == (200, "VERIFIED")
        assert collector.num_gpus_ready == 1
        reply = _chat(client, settings)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-inferno-tee"] == "VERIFIED"
    assert load_spy.num_calls == 1
    entries = _entries(settings)
    assert _actions(entries) == [
        ("boot.start", "success"),
        ("attestation.verdict", "success"),
        ("boot.ready", "success"),
    ]
    [verdict] = [e for e in entries if e["action"] == "attestation.verdict"]
    assert verdict["details"]["result"] == "trusted"
    assert verdict["details"]["trigger"] == "boot"
    assert verdict["details"]["attestation_public_key"] == tee.key.public_bytes.hex()
    [ready] = [e for e in entries if e["action"] == "boot.ready"]
    assert ready["details"]["tee"] == "VERIFIED"


class GatedPreload(EnginePreload):
    """The real preload, noting what the gate had done when it was let onto the GPUs."""

    collector: FakeCollector
    loads: LoadSpy
    warmed_when: list[tuple[int, int]]  # (GPUs set ready, loads begun) at each warm_device

    def warm_device(self, config: EngineConfig) -> None:
        self.warmed_when.append((self.collector.num_gpus_ready, self.loads.num_calls))
        super().warm_device(config)


def _gated_preload(settings: Settings, collector: FakeCollector, loads: LoadSpy) -> GatedPreload:
    preload = GatedPreload.start(settings.engine)
    assert isinstance(preload, GatedPreload)
    preload.collector, preload.loads, preload.warmed_when = collector, loads, []
    return preload


def test_the_preload_reaches_the_gpus_only_after_the_verdict_set_them_ready(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    collector = FakeCollector()
    preload = _gated_preload(settings, collector, load_spy)
    for client in _serve(settings, TeeService("required", collector, FakeVerifier()), preload):
        assert client.get("/health").status_code == 200
    # Let onto the GPUs once, after they were set ready and before the load began; the load
    # was handed the preload (and waited for it, as LoadedModel's loads do).
    assert preload.warmed_when == [(1, 0)]
    assert load_spy.preloads == [preload]
    assert preload.imports_s is not None
    preload.wait()
    # boot.ready names how long the load's thread waited for the preload's import of torch.
    [ready] = [e for e in _entries(settings) if e["action"] == "boot.ready"]
    assert ready["details"]["load_phases_ms"]["torch_wait_ms"] >= 0


def test_a_closed_gate_never_lets_the_preload_onto_the_gpus(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    collector = FakeCollector()
    verifier = FakeVerifier(failures={"gpu0.driver_version": "550.54.14 is not allowed"})
    preload = _gated_preload(settings, collector, load_spy)
    for client in _serve(settings, TeeService("required", collector, verifier), preload):
        assert client.get("/health").json()["status"] == "failed"
    preload.wait()  # cancelled: the thread ended after its imports
    assert (preload.warmed_when, preload.device_s, load_spy.num_calls) == ([], None, 0)


def test_a_failed_preload_fails_the_load_and_is_recorded(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    # Its own settings name a device torch cannot parse: the thread fails in its imports.
    broken = EnginePreload.start(settings.engine.model_copy(update={"device": "no-such-device"}))
    tee = TeeService("required", FakeCollector(), FakeVerifier())
    for client in _serve(settings, tee, broken):
        health = client.get("/health").json()
        assert health["status"] == "failed"
        assert health["reason"].startswith(
            "the model could not be loaded: the engine's preload failed: RuntimeError"
        )
    entries = _entries(settings)
    assert _actions(entries)[-1] == ("boot.phase", "failure")
    assert entries[-1]["details"]["phase"] == "model_load"


@pytest.mark.parametrize(
    ("collector", "verifier", "reason"),
    [
        (
            FakeCollector(),
            FakeVerifier(failures={"gpu0.driver_version": "550.54.14 is not allowed"}),
            "attestation failed: gpu0.driver_version: 550.54.14 is not allowed",
        ),
        (
            FakeCollector(fail_with="GPU 0: confidential computing is off"),
            FakeVerifier(),
            "attestation failed: collect: GPU 0: confidential computing is off",
        ),
    ],
    ids=["failing-check", "collection-failed"],
)
def test_a_closed_gate_loads_nothing_and_says_why_everywhere(
    tmp_path: Path,
    smollm2_dir: Path,
    load_spy: LoadSpy,
    collector: FakeCollector,
    verifier: FakeVerifier,
    reason: str,
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    for client in _serve(settings, TeeService("required", collector, verifier)):
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "reason": reason}
        assert health.headers["x-inferno-tee"] == "FAILED"
        refused = _chat(client, settings)
        assert refused.status_code == 503
        assert reason in refused.json()["error"]["message"]
        shown = client.get("/v1/attestation", params={"nonce": NONCE})
        assert shown.status_code == 200
        body = shown.json()
        assert body["tee"] == "FAILED"
        assert body["standing_verdict"]["result"] == "not trusted"
        failed = body["standing_verdict"]["failed"]
        assert reason.removeprefix("attestation failed: ").startswith(failed[0]["name"])
    assert load_spy.num_calls == 0
    assert collector.num_gpus_ready == 0
    entries = _entries(settings)
    assert ("boot.ready", "success") not in _actions(entries)
    [verdict] = [e for e in entries if e["action"] == "attestation.verdict"]
    assert (verdict["outcome"], verdict["details"]["result"]) == ("failure", "not trusted")
    assert verdict["details"]["failed"] == body["standing_verdict"]["failed"]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            CollectionError("NVML refused to set the GPUs ready state: NVML error 3"),
            "the GPUs could not be set ready after a passing verdict: NVML refused",
        ),
        (ImportError("no set_gpus_ready"), "the TEE gate failed (ImportError); see the server log"),
    ],
    ids=["refused", "unexpected"],
)
def test_gpus_that_cannot_be_set_ready_keep_the_gate_shut(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy, error: Exception, reason: str
) -> None:
    class GpusRefuseReady(FakeCollector):
        def set_gpus_ready(self) -> None:
            raise error

    settings = _settings(tmp_path, smollm2_dir)
    for client in _serve(settings, TeeService("required", GpusRefuseReady(), FakeVerifier())):
        health = client.get("/health").json()
        assert health["status"] == "failed"
        assert health["reason"].startswith(reason)
    assert load_spy.num_calls == 0


def test_a_failed_reattestation_stops_inference_and_is_recorded(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir, reattest_interval_s=0.2)
    verifier = FakeVerifier()
    for client in _serve(settings, TeeService("required", FakeCollector(), verifier)):
        assert _chat(client, settings).status_code == 200
        verifier.failures = {"cpu.snp.tcb": "microcode 200 is below the minimum 213"}
        deadline = time.monotonic() + 30
        while client.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "inference was never stopped"
            time.sleep(0.05)
        health = client.get("/health").json()
        assert health == {
            "status": "failed",
            "reason": "re-attestation failed: cpu.snp.tcb: microcode 200 is below the minimum 213",
        }
        refused = _chat(client, settings)
        assert (refused.status_code, refused.headers["x-inferno-tee"]) == (503, "FAILED")
        verifier.failures = {}
        time.sleep(0.5)  # a later pass does not bring it back
        assert client.get("/health").status_code == 503
    verdicts = [e for e in _entries(settings) if e["action"] == "attestation.verdict"]
    assert [(v["details"]["trigger"], v["outcome"]) for v in verdicts][-1] == (
        "reattest",
        "failure",
    )
    assert verdicts[0]["details"]["trigger"] == "boot"


def test_a_failure_a_client_sees_makes_the_appliance_reattest_at_once(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    # An hour between re-attestations: only the client's failed attestation can start one.
    settings = _settings(tmp_path, smollm2_dir, reattest_interval_s=3600)
    verifier = FakeVerifier()
    for client in _serve(settings, TeeService("required", FakeCollector(), verifier)):
        assert _chat(client, settings).status_code == 200
        verifier.failures = {"gpu0.measurements": "block 4 differs from the RIM"}
        seen = client.get("/v1/attestation", params={"nonce": NONCE}).json()
        assert seen["verdict"]["result"] == "not trusted"
        deadline = time.monotonic() + 30
        while client.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "the failure a client saw was never re-checked"
            time.sleep(0.05)
        assert client.get("/health").json()["reason"] == (
            "re-attestation failed: gpu0.measurements: block 4 differs from the RIM"
        )
        assert _chat(client, settings).status_code == 503
    verdicts = [e for e in _entries(settings) if e["action"] == "attestation.verdict"]
    assert [v["details"]["trigger"] for v in verdicts] == ["boot", "reattest"]


def test_a_client_attestation_that_passes_leaves_the_timer_alone(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir, reattest_interval_s=3600)
    tee = TeeService("required", FakeCollector(), FakeVerifier())
    for client in _serve(settings, tee):
        client.get("/v1/attestation", params={"nonce": NONCE})
        assert not tee.reattest_requested.is_set()
        assert client.get("/health").status_code == 200


def test_v1_attestation_returns_fresh_evidence_and_a_signed_verdict_for_the_nonce(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    tee = TeeService("required", FakeCollector(), FakeVerifier())
    for client in _serve(settings, tee):
        body = client.get("/v1/attestation", params={"nonce": NONCE}).json()
        for bad in ("5a" * 31, "not hex"):
            refused = client.get("/v1/attestation", params={"nonce": bad})
            assert (refused.status_code, refused.json()["error"]["param"]) == (400, "nonce")
    assert body["tee"] == "VERIFIED"
    assert body["nonce"] == NONCE
    assert body["evidence"]["challenge"] == NONCE
    assert body["verdict"]["result"] == "trusted"
    statement = verify_signed_verdict(body["signed_verdict"])
    assert statement["challenge"] == NONCE
    assert statement["attestation_public_key"] == body["evidence"]["attestation_public_key"]
    assert statement["report_data"] == body["evidence"]["report_data"]
    assert statement["verdict"] == body["verdict"]


def test_insecure_dev_serves_unverified_and_the_log_says_nothing_was_attested(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    settings = _settings(tmp_path, smollm2_dir, mode="insecure-dev")
    for client in _serve(settings, TeeService("insecure-dev", None, None)):
        reply = _chat(client, settings)
        assert (reply.status_code, reply.headers["x-inferno-tee"]) == (200, "UNVERIFIED")
        assert client.get("/health").headers["x-inferno-tee"] == "UNVERIFIED"
        shown = client.get("/v1/attestation", params={"nonce": NONCE})
        assert (shown.status_code, shown.json()["error"]["code"]) == (409, "tee_unverified")
    entries = _entries(settings)
    [skipped] = [e for e in entries if e["action"] == "attestation.verdict"]
    assert skipped["outcome"] == "failure"
    assert skipped["details"]["tee"] == "UNVERIFIED"
    assert skipped["details"]["result"] == "skipped"
    [ready] = [e for e in entries if e["action"] == "boot.ready"]
    assert ready["details"]["tee"] == "UNVERIFIED"


@pytest.fixture
def two_gpu_engine(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """An engine on two GPUs (tensor_parallel_size 2), as CUDA names them."""
    uuids = ["0a1b2c3d-0000-1111-2222-333344445555", "9f8e7d6c-0000-1111-2222-333344445555"]
    monkeypatch.setattr(EngineConfig, "on_gpu", property(lambda _config: True))
    monkeypatch.setattr(startup, "engine_gpu_uuids", lambda _device, _size: uuids)
    return uuids


def test_a_verdict_covering_exactly_the_engines_gpus_opens_the_gate(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy, two_gpu_engine: list[str]
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    collector = FakeCollector(gpu_uuids=tuple(f"GPU-{uuid}" for uuid in reversed(two_gpu_engine)))
    for client in _serve(settings, TeeService("required", collector, FakeVerifier())):
        assert client.get("/health").status_code == 200
    assert load_spy.num_calls == 1


def test_live_and_health_answer_while_the_coverage_check_waits_for_cuda(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 4b asks CUDA for the GPUs' UUIDs, which waits for the preload's import of torch
    (seconds on a GPU machine): the event loop keeps answering meanwhile."""
    uuid = "0a1b2c3d-0000-1111-2222-333344445555"
    asked, answer = threading.Event(), threading.Event()

    def slow_uuids(_device: str, _size: int) -> list[str]:
        asked.set()
        assert answer.wait(timeout=30)
        return [uuid]

    monkeypatch.setattr(EngineConfig, "on_gpu", property(lambda _config: True))
    monkeypatch.setattr(startup, "engine_gpu_uuids", slow_uuids)
    settings = _settings(tmp_path, smollm2_dir)
    collector = FakeCollector(gpu_uuids=(f"GPU-{uuid}",))
    log = start_audit_log(settings)
    app = build(settings, log, tee=TeeService("required", collector, FakeVerifier()))
    with TestClient(app) as client:
        assert asked.wait(timeout=30)
        assert client.get("/live", timeout=5).status_code == 200
        health = client.get("/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        answer.set()
        deadline = time.monotonic() + 60
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline, "the start-up sequence never ended"
            time.sleep(0.02)
        assert client.get("/health").status_code == 200
    assert load_spy.num_calls == 1


def test_a_verdict_missing_one_of_the_engines_gpus_keeps_the_gate_shut(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy, two_gpu_engine: list[str]
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    collector = FakeCollector(gpu_uuids=(f"GPU-{two_gpu_engine[0]}",))
    for client in _serve(settings, TeeService("required", collector, FakeVerifier())):
        health = client.get("/health")
        assert health.status_code == 503
        assert "covers 1 GPUs but the engine uses 2" in health.json()["reason"]
    assert load_spy.num_calls == 0  # no key, no weights, no worker
    assert _actions(_entries(settings)) == [
        ("boot.start", "success"),
        ("attestation.verdict", "success"),
        ("boot.phase", "failure"),
    ]


def _on_device(settings: Settings, device: str) -> Settings:
    return settings.model_copy(
        update={"engine": settings.engine.model_copy(update={"device": device})}
    )


def test_a_device_inferno_does_not_run_on_is_refused_before_the_server_starts(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    settings = _on_device(_settings(tmp_path, smollm2_dir), "gpu")
    tee = TeeService("required", FakeCollector(), FakeVerifier())
    with (
        start_audit_log(settings) as log,
        pytest.raises(EngineConfigError, match="device 'gpu': Inferno runs on cpu, cuda or cuda:N"),
    ):
        build(settings, log, tee=tee)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without a CUDA GPU, whatever it has: to torch, and to CUDA's driver
    (which step 4b asks: appliance.boot.cuda_driver)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(cuda_driver, "device_count", lambda: 0)


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize(
    ("mode", "phase", "reason"),
    [
        (
            "insecure-dev",
            "model_load",
            "the model could not be loaded: device 'cuda': no CUDA GPU is available here",
        ),
        (
            "required",
            "gpu_coverage",
            "the verdict does not cover the engine's GPUs: tensor_parallel_size 1 from cuda needs "
            "GPUs cuda:0..cuda:0; this machine has 0",
        ),
    ],
)
def test_a_gpu_this_machine_lacks_fails_the_start_where_the_engine_first_looks_for_it(
    tmp_path: Path, smollm2_dir: Path, mode: str, phase: str, reason: str
) -> None:
    """The early checks pass a GPU by its name (they run without torch, while the preload
    imports it); the engine's GPUs are first looked for after the verdict (step 4b, for the
    verdict to cover them) or, unattested, as the model loads: there the start fails, recorded
    and on /health, before any weight is read."""
    settings = _on_device(_settings(tmp_path, smollm2_dir, mode=mode), "cuda")
    tee = (
        TeeService("required", FakeCollector(), FakeVerifier())
        if mode == "required"
        else TeeService("insecure-dev", None, None)
    )
    for client in _serve(settings, tee):
        health = client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "failed", "reason": reason})
    entries = _entries(settings)
    assert _actions(entries)[-1] == ("boot.phase", "failure")
    assert entries[-1]["details"]["phase"] == phase


def test_an_engine_that_stops_on_an_error_is_recorded_and_health_says_stopped(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As when a tensor-parallel worker dies mid-step (tests/appliance/engine/parallel)."""

    def dead_worker_step() -> list[Any]:
        raise TensorParallelError("tensor-parallel worker rank 1 (pid 1) killed by signal 9")

    monkeypatch.setattr(load_spy.engine, "step", dead_worker_step)
    settings = _settings(tmp_path, smollm2_dir, mode="insecure-dev")
    for client in _serve(settings, TeeService("insecure-dev", None, None)):
        assert _chat(client, settings).status_code == 503
        deadline = time.monotonic() + 10
        while client.get("/health").json()["status"] != "stopped":
            assert time.monotonic() < deadline, "health never said the engine stopped"
            time.sleep(0.02)
        assert client.get("/health").status_code == 503
    [stopped] = [e for e in _entries(settings) if e["action"] == "engine.stopped"]
    assert (stopped["outcome"], stopped["details"]) == ("failure", {"error": "TensorParallelError"})


def test_a_model_loaded_before_the_gate_is_refused_in_required_mode(
    tmp_path: Path, smollm2_dir: Path, engine: Engine
) -> None:
    settings = _settings(tmp_path, smollm2_dir)
    tee = TeeService("required", FakeCollector(), FakeVerifier())
    with start_audit_log(settings) as log, pytest.raises(BootError, match="before the TEE gate"):
        build(settings, log, model=LoadedModel(engine, "sha256:00"), tee=tee)


def _production(directory: Path, model_dir: Path, **sections: Any) -> dict[str, Any]:
    return {
        "model": {"dir": str(model_dir)},
        "tls": {"cert_file": "c.pem", "key_file": "k.pem", "self_signed": True},
        "audit": {"origin": "inferno.test/gate", "data_dir": "audit"},
        "auth": {"local_issuer": "break-glass", "local_issuer_key_file": "i.pem"} | {
            "issuers": [
                {"issuer": "https://idp.example.com", "audience": "inferno",
                 "jwks_file": "jwks.json", "role_claims": ["roles"], "roles": {"user": ["u"]}}
            ]
        },
        "tee": {"policy_file": "p.toml", "gpu_rims_dir": "rims"},
        **sections,
    }  # fmt: skip


def test_production_is_the_default_and_accepts_a_secure_config(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    settings = settings_from_mapping(_production(tmp_path, smollm2_dir), base_dir=tmp_path)
    assert (settings.appliance.profile, settings.tee.mode) == ("production", "required")


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"tee": {"mode": "insecure-dev"}}, 'tee.mode = "insecure-dev"'),
        ({"server": {"insecure_http": True}, "tls": {}}, "server.insecure_http = true"),
        (
            {"auth": {"local_issuer": "demo", "local_issuer_key_file": "i.pem"}},
            'auth.local_issuer = "demo"',
        ),
        (
            {
                "sealed": {
                    "manifest_public_key_file": "m.pem",
                    "key_provider": "file",
                    "file_key_dir": "keks",
                }
            },
            'sealed.key_provider = "file"',
        ),
    ],
    ids=["tee-insecure-dev", "plain-http", "demo-issuer", "file-key-provider"],
)
def test_production_refuses_each_insecure_setting_by_name(
    tmp_path: Path, smollm2_dir: Path, change: dict[str, Any], refusal: str
) -> None:
    raw = _production(tmp_path, smollm2_dir, **change)
    with pytest.raises(ConfigError, match=f'appliance.profile = "production" refuses {refusal}'):
        settings_from_mapping(raw, base_dir=tmp_path)
    development = {**raw, "appliance": {"profile": "development"}}
    settings_from_mapping(development, base_dir=tmp_path)


def test_a_config_silent_about_the_tee_is_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    raw = _production(tmp_path, smollm2_dir)
    del raw["tee"]
    with pytest.raises(ConfigError, match='tee: mode "required" needs policy_file, gpu_rims_dir:'):
        settings_from_mapping(raw, base_dir=tmp_path)


def test_a_sealed_model_needs_the_tee_and_a_complete_key_provider(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    sealed = {"manifest_public_key_file": "m.pem", "key_provider": "pkcs11"}
    raw = _production(tmp_path, smollm2_dir, sealed=sealed)
    with pytest.raises(
        ConfigError, match="sealed: a sealed model needs hsm_module, hsm_token_label"
    ):
        settings_from_mapping(raw, base_dir=tmp_path)
    sealed |= {"hsm_module": "p11.so", "hsm_token_label": "inferno", "hsm_pin_file": "pin"}
    development = {
        **_production(tmp_path, smollm2_dir, sealed=sealed),
        "appliance": {"profile": "development"},
        "tee": {"mode": "insecure-dev"},
    }
    with pytest.raises(ConfigError, match=r'a sealed model needs tee\.mode = "required"'):
        settings_from_mapping(development, base_dir=tmp_path)
    settings = settings_from_mapping(
        _production(tmp_path, smollm2_dir, sealed=sealed), base_dir=tmp_path
    )
    assert settings.sealed.enabled


def test_this_machine_is_no_tee_so_the_real_gate_stays_shut_and_says_why(
    tmp_path: Path, smollm2_dir: Path, load_spy: LoadSpy
) -> None:
    """The default service attests the machine's own devices (NVML, configfs-tsm). A test
    machine has no confidential VM (and, in CI, no NVIDIA driver): the gate stays shut, saying
    what could not be collected."""
    (tmp_path / "policy.toml").write_text('[gpu]\ndriver_versions = ["550.90.07"]\n')
    (tmp_path / "rims").mkdir()
    settings = _settings(tmp_path, smollm2_dir, tsm_report_dir=str(tmp_path / "no-tsm"))
    log = start_audit_log(settings)
    with TestClient(build(settings, log)) as client:
        deadline = time.monotonic() + 120
        while (health := client.get("/health")).json()["status"] == "loading":
            assert time.monotonic() < deadline, "the start-up sequence never ended"
            time.sleep(0.05)
        assert health.status_code == 503
        assert health.json()["reason"].startswith("attestation failed: collect: ")
        assert health.headers["x-inferno-tee"] == "FAILED"
    assert load_spy.num_calls == 0
