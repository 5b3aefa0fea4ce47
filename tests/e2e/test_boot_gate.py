"""End to end: the boot gate over synthetic devices, with the real collection, binding and
offline verifiers, a sealed model and a key provider that is watched.

The devices are synthetic (tests/attestation/gpu/synthetic.py: a test CA shaped like NVIDIA's
5-certificate chain signing SPDM reports for any nonce, RIMs under a test CoRIM root;
tests/attestation/cpu/synthetic.py: a test ARK/ASK/VCEK chain signing SEV-SNP reports). They are
trusted only because this test's `[tee]` settings pin their roots, exactly as a deployment pins
NVIDIA's and AMD's. The model is the embedded SmolLM2, sealed with the `file` key provider.

Shown: a pass releases the key, loads the sealed weights and serves inference, and a client can
verify the appliance through /v1/attestation; each policy violation (wrong driver version,
dev-tools on, a debug CPU, a replayed nonce, a bad measurement) releases no key (the provider is
never called), loads no weight, and /health and /v1/attestation say why; a failed
re-attestation stops inference; collateral from a signed trust bundle opens the gate while it is
fresh and closes it, naming its age, once the policy's maximum age is past.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from fastapi.testclient import TestClient

from appliance.app import build
from appliance.attestation.challenge import gpu_nonces
from appliance.attestation.devices import EvidenceCollection, OfflineVerifier
from appliance.attestation.service import TeeService
from appliance.attestation.signing import verify_signed_verdict
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.auth.sessions import SESSION_COOKIE
from appliance.boot.audit_log import open_audit_log
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel, digest_weights
from appliance.config import Settings, settings_from_mapping
from appliance.tls import ensure_self_signed_certificate
from appliance.trust_store import TrustStore
from attestation.binding import Channel, report_data_v2
from attestation.cpu import CpuEvidence, CpuTrust, verify_cpu_evidence
from attestation.gpu import GpuEvidence, GpuTrust, gpu_evidence_digest, verify_gpu_evidence
from attestation.keys.file import FileKeyProvider
from attestation.keys.pkcs11 import Pkcs11KeyProvider
from attestation.sealed.writer import seal_model
from attestation.verdict import Verdict
from tests.appliance.attestation.synthetic_tee import SyntheticCpu, SyntheticGpus, write_policy
from tests.attestation.cpu.synthetic import SyntheticSnp
from tests.attestation.gpu.synthetic import SyntheticGpuSetup, synthetic_gpu_setup
from tests.attestation.keys.softhsm import softhsm_module, softhsm_token
from tests.attestation.trust_bundles import build_trust_bundle, make_release_key

KEY_ID = "smollm2-kek"
NUM_GPUS = 2

pytestmark = pytest.mark.slow


class KeyProviderSpy:
    """The file provider, with every release recorded (and the verdict it was given)."""

    def __init__(self, key_dir: Path) -> None:
        self.provider = FileKeyProvider(key_dir, production=False)
        self.releases: list[Verdict] = []

    def wrap_data_key(self, key_id: str, data_key: bytes) -> bytes:
        return self.provider.wrap_data_key(key_id, data_key)

    def release_data_key(self, key_id: str, wrapped_key: bytes, verdict: Verdict) -> bytes:
        self.releases.append(verdict)
        return self.provider.release_data_key(key_id, wrapped_key, verdict)


@dataclass(frozen=True)
class Deployment:
    """What an operator installs: the sealed model and its keys, the pinned roots, the RIMs and
    the policy; and the synthetic machine it runs on."""

    directory: Path
    plain_dir: Path
    sealed_dir: Path
    manifest_key_file: Path
    key_dir: Path
    weights_digest: str
    gpus: SyntheticGpuSetup
    snp: SyntheticSnp
    policy_file: Path
    cpu_trust_dir: Path


@pytest.fixture(scope="module")
def deployment(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    directory = tmp_path_factory.mktemp("deployment")
    key_dir = directory / "keks"
    sealer = FileKeyProvider(key_dir, production=False)
    sealer.create_key(KEY_ID)
    signing_key = Ed25519PrivateKey.generate()
    manifest_key_file = directory / "manifest-key.pem"
    manifest_key_file.write_bytes(
        signing_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    sealed_dir = directory / "sealed-smollm2"
    seal_model(
        smollm2_dir,
        sealed_dir,
        model_id="smollm2",
        key_id=KEY_ID,
        wrap_data_key=sealer.wrap_data_key,
        signing_key=signing_key,
    )
    assert not list(sealed_dir.glob("*.safetensors")), "no plaintext weight in the sealed dir"
    gpus = synthetic_gpu_setup(directory / "gpu", num_gpus=NUM_GPUS)
    snp = SyntheticSnp.create()
    policy = {"gpu": gpus.policy_table(), "snp": snp.policy_table()}
    return Deployment(
        directory=directory,
        plain_dir=smollm2_dir,
        sealed_dir=sealed_dir,
        manifest_key_file=manifest_key_file,
        key_dir=key_dir,
        weights_digest=digest_weights(smollm2_dir),
        gpus=gpus,
        snp=snp,
        policy_file=write_policy(directory / "attestation-policy.toml", policy),
        cpu_trust_dir=snp.write_trust_directory(directory / "cpu-trust"),
    )


def _settings(deployment: Deployment, directory: Path, **tee: Any) -> Settings:
    return settings_from_mapping(
        {
            "model": {"dir": str(deployment.sealed_dir), "name": "smollm2"},
            "engine": {"max_model_len": 256, "num_kv_blocks": 64},
            "server": {"insecure_http": True},
            "audit": {"origin": "inferno.test/e2e-gate", "data_dir": str(directory / "audit")},
            "auth": {"local_issuer": "demo", "local_issuer_key_file": "issuer.pem"},
            "appliance": {"profile": "development"},  # for the file key provider
            "tee": {
                "mode": "required",
                "policy_file": str(deployment.policy_file),
                "gpu_rims_dir": str(deployment.gpus.rim_dir),
                "gpu_roots_dir": str(deployment.gpus.roots_dir),
                "cpu_trust_dir": str(deployment.cpu_trust_dir),
                **tee,
            },
            "sealed": {
                "manifest_public_key_file": str(deployment.manifest_key_file),
                "key_provider": "file",
                "file_key_dir": str(deployment.key_dir),
            },
        },
        base_dir=directory,
    )


@dataclass
class Appliance:
    client: TestClient
    settings: Settings
    tee: TeeService
    gpus: SyntheticGpus
    cpu: SyntheticCpu

    def chat(self) -> Any:
        issuer = LocalIssuer.from_settings(self.settings.auth)
        assert issuer is not None
        token = issuer.mint(Role.USER, "e2e", time.time())
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        return self.client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
        )

    def console_page(self, path: str) -> str:
        """A console page as an admin sees it (a session made in the appliance's store)."""
        principal = Principal("urn:e2e", "operator", None, frozenset({Role.ADMIN}), 0.0)
        session = self.client.app.state.sessions.create(principal, "id.token")  # type: ignore[attr-defined]
        self.client.cookies.set(SESSION_COOKIE, session.id)
        page = self.client.get(path)
        assert page.status_code == 200, page.text
        return page.text

    def entries(self) -> list[dict[str, Any]]:
        with open_audit_log(self.settings.audit) as log:
            return [json.loads(leaf) for _, leaf in log.store.entries(0, log.store.size() - 1)]


def _boot(
    deployment: Deployment,
    directory: Path,
    keys: KeyProviderSpy,
    gpus: SyntheticGpus,
    cpu: SyntheticCpu,
    **tee: Any,
) -> Iterator[Appliance]:
    settings = _settings(deployment, directory, **tee)
    service = TeeService("required", EvidenceCollection(gpus, cpu), OfflineVerifier(settings.tee))
    app = build(settings, start_audit_log(settings), tee=service, keys=keys)
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline, "the start-up sequence never ended"
            time.sleep(0.05)
        yield Appliance(client, settings, service, gpus, cpu)


class LoadSpy:
    def __init__(self) -> None:
        self.num_calls = 0


@pytest.fixture
def sealed_loads(monkeypatch: pytest.MonkeyPatch) -> LoadSpy:
    """Counts sealed weight loads (and plain ones, which must never happen here)."""
    spy = LoadSpy()
    load_sealed = LoadedModel.load_sealed

    def counted(*args: Any, **kwargs: Any) -> LoadedModel:
        spy.num_calls += 1
        return load_sealed(*args, **kwargs)

    def refused(*args: Any, **kwargs: Any) -> LoadedModel:
        raise AssertionError("a sealed deployment loaded a plain model")

    monkeypatch.setattr(LoadedModel, "load_sealed", counted)
    monkeypatch.setattr(LoadedModel, "load", refused)
    return spy


def _client_verifies(deployment: Deployment, body: dict[str, Any], nonce: bytes, vkey: str) -> None:
    """What a client does with /v1/attestation, with its own pinned roots and policy: the
    signature of the verdict, the key binding in the CPU report, and both verifications."""
    statement = verify_signed_verdict(body["signed_verdict"])
    assert body["evidence"]["audit_vkey"] == vkey
    evidence = body["evidence"]
    public_key = bytes.fromhex(statement["attestation_public_key"])
    gpu = [GpuEvidence.from_json(item) for item in evidence["gpu"]]
    # Plain HTTP here (TestClient): the channel binds no TLS key, only the audit log's vkey.
    # tests/e2e/test_attested_channel.py verifies a TLS channel's binding.
    assert evidence["tls_spki_sha256"] is None
    channel = Channel(None, evidence["audit_vkey"])
    expected = report_data_v2(nonce, gpu_evidence_digest(gpu), public_key, channel)
    assert statement["report_data"] == expected.hex()
    now = datetime.now(UTC)
    cpu = verify_cpu_evidence(
        CpuEvidence.from_json(evidence["cpu"]),
        expected_report_data=expected,
        policy=deployment.snp.policy(),
        trust=CpuTrust.load(deployment.cpu_trust_dir),
        at=now,
    )
    gpus = verify_gpu_evidence(
        gpu,
        expected_nonces=gpu_nonces(nonce, len(gpu)),
        policy=deployment.gpus.policy(),
        trust=GpuTrust.from_paths(
            rim_dir=deployment.gpus.rim_dir, roots_dir=deployment.gpus.roots_dir
        ),
        at=now,
    )
    assert cpu.trusted and gpus.trusted, (cpu.failures, gpus.failures)
    assert statement["verdict"]["result"] == "trusted"


def test_a_passing_tee_releases_the_key_loads_the_sealed_weights_and_serves(
    deployment: Deployment, tmp_path: Path, sealed_loads: LoadSpy
) -> None:
    keys = KeyProviderSpy(deployment.key_dir)
    gpus, cpu = SyntheticGpus(deployment.gpus), SyntheticCpu(deployment.snp)
    for appliance in _boot(deployment, tmp_path, keys, gpus, cpu):
        health = appliance.client.get("/health")
        assert (health.status_code, health.headers["x-inferno-tee"]) == (200, "VERIFIED")
        reply = appliance.chat()
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        assert reply.headers["x-inferno-tee"] == "VERIFIED"
        nonce = bytes(range(32))
        shown = appliance.client.get("/v1/attestation", params={"nonce": nonce.hex()})
        vkey = appliance.client.app.state.audit_trail.log.vkey  # type: ignore[attr-defined]
        _client_verifies(deployment, shown.json(), nonce, vkey)
        # Every inference entry names the verdict in force, as the header does.
        standing = appliance.tee.verdict_in_force()
        assert reply.headers["x-inferno-attestation"].startswith(f"id={standing}; age=")
        # The console's Overview names the sealed manifest the key was released for.
        overview = appliance.console_page("/console/")
        manifest = json.loads((deployment.sealed_dir / "manifest.json").read_text())
        assert f'seal id <code class="digest">{manifest["seal_id"]}</code>' in overview
        assert f"under key <code>{KEY_ID}</code>" in overview
        assert deployment.weights_digest in overview and "VERIFIED" in overview
    assert [verdict.trusted for verdict in keys.releases] == [True]
    assert sealed_loads.num_calls == 1
    assert gpus.num_set_ready == 1
    entries = appliance.entries()
    [verdict] = [e for e in entries if e["action"] == "attestation.verdict"]
    assert verdict["outcome"] == "success"
    assert verdict["details"]["claims"]["gpu"], "the verified GPU claims are recorded"
    assert verdict["details"]["verdict_id"] == standing
    inference = [e for e in entries if e["action"].startswith("inference.")]
    assert [e["details"]["verdict_id"] for e in inference] == [standing, standing]
    [ready] = [e for e in entries if e["action"] == "boot.ready"]
    # The sealed model is named by the same digest as the plain one it was sealed from.
    assert ready["details"]["weights_digest"] == deployment.weights_digest
    assert ready["details"]["tee"] == "VERIFIED"
    assert ready["details"]["attestation_ms"] > 0
    assert ready["details"]["model_load_ms"] > 0
    # Its parts, each timed: the key's release, the decryption into the model, the engine.
    phases = ready["details"]["load_phases_ms"]
    assert set(phases) == {"key_release_ms", "weights_ms", "engine_build_ms"}
    assert all(ms > 0 for ms in phases.values())
    assert sum(phases.values()) <= ready["details"]["model_load_ms"]


VIOLATIONS = {
    "wrong-driver-version": (
        {"overrides": {"driver_version": "550.54.14"}},
        {},
        "gpu0.policy.driver_version",
    ),
    "dev-tools-on": ({"overrides": {"dev_tools_mode": True}}, {}, "gpu0.policy.dev_tools"),
    "debug-cpu": ({}, {"options": {"debug": True}}, "snp.policy.debug"),
    "replayed-nonce": ({"replay_challenge": bytes(32)}, {}, "gpu0.nonce"),
    "bad-measurement": (
        {"overrides": {"measurements": {5: bytes(48)}}},
        {},
        "gpu0.measurements",
    ),
}


@pytest.mark.parametrize("violation", VIOLATIONS)
def test_each_policy_violation_releases_no_key_loads_nothing_and_says_why(
    deployment: Deployment, tmp_path: Path, sealed_loads: LoadSpy, violation: str
) -> None:
    gpu_options, cpu_options, failed_check = VIOLATIONS[violation]
    keys = KeyProviderSpy(deployment.key_dir)
    gpus = SyntheticGpus(deployment.gpus, **gpu_options)
    cpu = SyntheticCpu(deployment.snp, **cpu_options)
    for appliance in _boot(deployment, tmp_path, keys, gpus, cpu):
        health = appliance.client.get("/health")
        assert health.status_code == 503
        assert health.headers["x-inferno-tee"] == "FAILED"
        reason = health.json()["reason"]
        assert reason.startswith("attestation failed: ")
        assert f"{failed_check}: " in reason
        assert appliance.chat().status_code == 503
        shown = appliance.client.get("/v1/attestation", params={"nonce": "11" * 32}).json()
        assert failed_check in {c["name"] for c in shown["standing_verdict"]["failed"]}
        assert failed_check in {c["name"] for c in shown["verdict"]["failed"]}
        assert shown["tee"] == "FAILED"
    assert keys.releases == [], "the key provider was called"
    assert sealed_loads.num_calls == 0
    assert gpus.num_set_ready == 0, "the GPUs were set ready"
    actions = [e["action"] for e in appliance.entries()]
    assert "boot.ready" not in actions
    assert actions.count("attestation.verdict") == 1


def test_a_failed_reattestation_stops_inference(
    deployment: Deployment, tmp_path: Path, sealed_loads: LoadSpy
) -> None:
    keys = KeyProviderSpy(deployment.key_dir)
    gpus, cpu = SyntheticGpus(deployment.gpus), SyntheticCpu(deployment.snp)
    for appliance in _boot(deployment, tmp_path, keys, gpus, cpu, reattest_interval_s=0.5):
        assert appliance.chat().status_code == 200
        cpu.options = {"debug": True}  # the guest is now debuggable
        deadline = time.monotonic() + 60
        while appliance.client.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "inference was never stopped"
            time.sleep(0.05)
        health = appliance.client.get("/health")
        assert health.json()["reason"].startswith("re-attestation failed: snp.policy.debug: ")
        assert appliance.chat().status_code == 503
        assert health.headers["x-inferno-tee"] == "FAILED"
    verdicts = [e for e in appliance.entries() if e["action"] == "attestation.verdict"]
    assert verdicts[0]["details"]["trigger"] == "boot"
    assert (verdicts[-1]["details"]["trigger"], verdicts[-1]["outcome"]) == (
        "reattest",
        "failure",
    )
    assert len(keys.releases) == 1, "the key is released once, at boot"


def test_a_manifest_signed_by_another_key_is_refused_before_any_key_is_released(
    deployment: Deployment, tmp_path: Path, sealed_loads: LoadSpy
) -> None:
    impostor = tmp_path / "impostor.pem"
    impostor.write_bytes(
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    pinned = Deployment(**{**deployment.__dict__, "manifest_key_file": impostor})
    keys = KeyProviderSpy(deployment.key_dir)
    gpus, cpu = SyntheticGpus(deployment.gpus), SyntheticCpu(deployment.snp)
    for appliance in _boot(pinned, tmp_path, keys, gpus, cpu):
        health = appliance.client.get("/health")
        assert health.status_code == 503
        assert health.headers["x-inferno-tee"] == "VERIFIED"  # the TEE is fine; the model is not
        assert health.json()["reason"].startswith("the model could not be loaded: ")
        assert "signature" in health.json()["reason"]
    assert keys.releases == []
    assert sealed_loads.num_calls == 0
    [failed] = [e for e in appliance.entries() if e["action"] == "boot.phase"]
    assert (failed["outcome"], failed["details"]["phase"]) == ("failure", "model_load")


def test_a_key_the_provider_cannot_unwrap_loads_nothing_and_is_recorded(
    deployment: Deployment, tmp_path: Path, sealed_loads: LoadSpy
) -> None:
    other_keks = tmp_path / "other-keks"
    FileKeyProvider(other_keks, production=False).create_key(KEY_ID)  # same id, other key
    keys = KeyProviderSpy(other_keks)
    gpus, cpu = SyntheticGpus(deployment.gpus), SyntheticCpu(deployment.snp)
    for appliance in _boot(deployment, tmp_path, keys, gpus, cpu):
        health = appliance.client.get("/health")
        assert health.status_code == 503
        assert health.json()["reason"].startswith("the model could not be loaded: ")
        assert appliance.chat().status_code == 503
    assert [verdict.trusted for verdict in keys.releases] == [True]
    assert sealed_loads.num_calls == 0
    [failed] = [e for e in appliance.entries() if e["action"] == "boot.phase"]
    assert (failed["outcome"], failed["details"]["phase"]) == ("failure", "key_release")


def test_a_production_appliance_unseals_through_the_hsm_after_a_passing_verdict(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The production profile end to end: TLS settings, an identity provider (here with the
    local issuer as its break-glass companion, to mint the test's token), the TEE required, and
    the sealed model's key unwrapped inside a PKCS#11 token (SoftHSM2) by the provider the
    settings name, not a test double."""
    if softhsm_module() is None:
        pytest.skip("SoftHSM2 is not installed (./bootstrap test installs Debian's softhsm2)")
    token = softhsm_token()
    key_label = f"kek-boot-gate-{uuid.uuid4().hex[:8]}"  # the shared token holds only kek-*
    hsm = Pkcs11KeyProvider.from_settings(token)
    hsm.create_key(key_label)
    signing_key = Ed25519PrivateKey.generate()
    manifest_key_file = tmp_path / "manifest-key.pem"
    manifest_key_file.write_bytes(
        signing_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    sealed_dir = tmp_path / "sealed"
    seal_model(
        deployment.plain_dir,
        sealed_dir,
        model_id="smollm2",
        key_id=key_label,
        wrap_data_key=hsm.wrap_data_key,
        signing_key=signing_key,
    )
    idp_key = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    jwk = {"kty": "OKP", "crv": "Ed25519", "kid": "idp-1", "use": "sig", "alg": "EdDSA",
           "x": base64.urlsafe_b64encode(idp_key).rstrip(b"=").decode()}  # fmt: skip
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    raw = {
        "model": {"dir": str(sealed_dir), "name": "smollm2"},
        "engine": {"max_model_len": 256, "num_kv_blocks": 64},
        "tls": {"cert_file": "tls/cert.pem", "key_file": "tls/key.pem", "self_signed": True},
        "audit": {"origin": "inferno.test/e2e-production", "data_dir": "audit"},
        "auth": {
            "issuers": [
                {"issuer": "https://idp.example.com", "audience": "inferno",
                 "jwks_file": "jwks.json", "role_claims": ["roles"], "roles": {"user": ["u"]}}
            ],
            "local_issuer": "break-glass",
            "local_issuer_key_file": "issuer.pem",
        },
        "tee": {
            "policy_file": str(deployment.policy_file),
            "gpu_rims_dir": str(deployment.gpus.rim_dir),
            "gpu_roots_dir": str(deployment.gpus.roots_dir),
            "cpu_trust_dir": str(deployment.cpu_trust_dir),
        },
        "sealed": {
            "manifest_public_key_file": str(manifest_key_file),
            "key_provider": "pkcs11",
            "hsm_module": str(token.module_path),
            "hsm_token_label": token.token_label,
            "hsm_pin_file": str(token.pin_file),
        },
    }  # fmt: skip
    settings = settings_from_mapping(raw, base_dir=tmp_path)
    assert settings.appliance.profile == "production"
    # What `listen` does before the server starts: the attestation binds this certificate's key.
    ensure_self_signed_certificate(tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem")
    gpus, cpu = SyntheticGpus(deployment.gpus), SyntheticCpu(deployment.snp)
    service = TeeService("required", EvidenceCollection(gpus, cpu), OfflineVerifier(settings.tee))
    app = build(settings, start_audit_log(settings), tee=service)
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while (health := client.get("/health")).json()["status"] == "loading":
            assert time.monotonic() < deadline, "the start-up sequence never ended"
            time.sleep(0.05)
        assert (health.status_code, health.headers["x-inferno-tee"]) == (200, "VERIFIED")
        appliance = Appliance(client, settings, service, gpus, cpu)
        reply = appliance.chat()
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-inferno-tee"] == "VERIFIED"
    [ready] = [e for e in appliance.entries() if e["action"] == "boot.ready"]
    assert ready["details"]["weights_digest"] == deployment.weights_digest


@pytest.mark.parametrize("age_days", [16, 1], ids=["stale", "fresh"])
def test_collateral_from_a_trust_bundle_passes_fresh_and_fails_stale_naming_its_age(
    deployment: Deployment, tmp_path: Path, sealed_loads: LoadSpy, age_days: int
) -> None:
    """The collateral comes from a signed trust bundle in `tee.trust_dir`; the policy allows it
    a week. A stale bundle closes the gate with `collateral.age` naming the age, a fresh one
    opens it, and the verdict and the console name the bundle either way."""
    release_key, release_pub = make_release_key(tmp_path / "release")
    created = datetime.now(UTC).replace(microsecond=0) - timedelta(days=age_days)
    bundle = build_trust_bundle(
        tmp_path / "bundle", release_key, created,
        gpu_rims=deployment.gpus.rim_dir, cpu_trust=deployment.cpu_trust_dir,
    )  # fmt: skip
    store = TrustStore(tmp_path / "trust", release_pub)
    installed = store.update(bundle, lambda new, replaced: None).id
    policy = {"gpu": deployment.gpus.policy_table(), "snp": deployment.snp.policy_table(),
              "collateral": {"max_age_s": 7 * 86400}}  # fmt: skip
    tee = {
        "policy_file": str(write_policy(tmp_path / "policy.toml", policy)),
        "gpu_rims_dir": None,
        "cpu_trust_dir": None,
        "trust_dir": str(store.directory),
        "trust_release_key": str(release_pub),
    }
    keys = KeyProviderSpy(deployment.key_dir)
    gpus, cpu = SyntheticGpus(deployment.gpus), SyntheticCpu(deployment.snp)
    for appliance in _boot(deployment, tmp_path, keys, gpus, cpu, **tee):
        health = appliance.client.get("/health")
        page = appliance.console_page("/console/attestation")
    assert f'<code class="digest">{installed.digest}</code>' in page
    assert f"{age_days} day{'s' if age_days > 1 else ''} old" in page
    [verdict] = [e for e in appliance.entries() if e["action"] == "attestation.verdict"]
    assert verdict["details"]["claims"]["collateral"] == {"trust_bundle": installed.to_json()}
    if age_days == 1:
        assert health.status_code == 200, health.text
        assert len(keys.releases) == 1 and sealed_loads.num_calls == 1
        return
    assert health.status_code == 503
    reason = health.json()["reason"]
    assert reason.startswith(
        f"attestation failed: collateral.age: trust bundle {installed.digest[:16]}… created "
    )
    # The age in seconds is 16 days plus however long the boot took to get to the check.
    age = re.search(r"is 16 days old \((\d+) s\)", reason)
    assert age and 16 * 86400 <= int(age.group(1)) < 16 * 86400 + 3600, reason
    assert "the policy allows 7 days" in reason
    assert keys.releases == [] and sealed_loads.num_calls == 0
