"""The boot gate's TDX path, with Intel's collateral supplied the only way an air-gapped site can:
`tee.cpu_trust_dir` (issue 13, defect 1).

The CPU evidence is real: dcap-qvl's TDX quote (tests/attestation/vectors/cpu/dcap-qvl), served
by a CpuEvidenceSource as configfs-tsm would serve it, with its DCAP collateral as the only file
of the trust directory (`tdx/collateral/b0c06f.json`, no `tdx/root_ca.pem`: Intel's SGX Root CA
is built in). The GPUs are synthetic (tests/attestation/gpu/synthetic.py), their roots pinned by
`tee.gpu_roots_dir`. The TEE service's clock is set inside the collateral's validity window
(TDX_AT), since Intel's TCB info has long expired.

Exercised as in production: `build()`'s gate (TeeService.attest("boot"), the verdict recorded,
/health), EvidenceCollection, OfflineVerifier reading `tee.policy_file` ([gpu] and [tdx]) and
loading `tee.cpu_trust_dir` with CpuTrust.load, dcap-qvl's DCAP verification against the
built-in Intel root (PCK chain, CRLs, TCB info, QE identity, quote signature), the TDX policy.

Not exercised, because a real quote's report_data cannot be chosen: the binding of the quote to
the challenge, the GPU evidence digest and the attestation key. The first test shows that the
binding is still checked (the quote fails `tdx.report_data` and nothing else); the second
replaces the binding function of appliance.attestation.devices by one that returns the quote's
own report_data, so that the gate can pass. The binding itself is tested with synthetic SEV-SNP
guests (tests/appliance/attestation/test_devices.py, tests/e2e/test_boot_gate.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from appliance.app import build
from appliance.attestation.devices import EvidenceCollection, OfflineVerifier
from appliance.attestation.service import TeeService
from appliance.boot.startup import start_audit_log
from appliance.boot.weights import LoadedModel
from appliance.config import Settings, settings_from_mapping
from appliance.engine.engine import Engine
from attestation.cpu import CpuEvidence
from tests.appliance.attestation.synthetic_tee import SyntheticGpus, write_policy
from tests.attestation.cpu.conftest import DCAP, DCAP_MR_TD, DCAP_REPORT_DATA, TDX_AT
from tests.attestation.gpu.synthetic import SyntheticGpuSetup, synthetic_gpu_setup


class DcapTdxQuote:
    """The CpuEvidenceSource of a TD that always answers with dcap-qvl's real quote."""

    def collect(self, report_data: bytes) -> CpuEvidence:
        return CpuEvidence("tdx", (DCAP / "tdx_quote").read_bytes(), provider="tdx_guest")


@pytest.fixture(scope="module")
def gpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGpuSetup:
    return synthetic_gpu_setup(tmp_path_factory.mktemp("gpus"), num_gpus=1)


@pytest.fixture(scope="module")
def engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=256, num_kv_blocks=64)


def _settings(directory: Path, model_dir: Path, gpus: SyntheticGpuSetup) -> Settings:
    collateral = directory / "cpu-trust" / "tdx" / "collateral"
    collateral.mkdir(parents=True)
    (collateral / "b0c06f.json").write_text((DCAP / "tdx_quote_collateral.json").read_text())
    tdx = {"mrtd": [DCAP_MR_TD], "tcb_statuses": ["UpToDate"]}
    policy = write_policy(directory / "policy.toml", {"gpu": gpus.policy_table(), "tdx": tdx})
    return settings_from_mapping(
        {
            "model": {"dir": str(model_dir), "name": "smollm2"},
            "server": {"insecure_http": True},
            "audit": {"origin": "inferno.test/gate-tdx", "data_dir": str(directory / "audit")},
            "auth": {"local_issuer": "demo", "local_issuer_key_file": "issuer.pem"},
            "appliance": {"profile": "development"},
            "tee": {
                "mode": "required",
                "policy_file": str(policy),
                "gpu_rims_dir": str(gpus.rim_dir),
                "gpu_roots_dir": str(gpus.roots_dir),
                "cpu_trust_dir": str(directory / "cpu-trust"),
            },
        },
        base_dir=directory,
    )


def _serve(settings: Settings, gpus: SyntheticGpuSetup) -> Iterator[TestClient]:
    collection = EvidenceCollection(SyntheticGpus(gpus), DcapTdxQuote())
    tee = TeeService("required", collection, OfflineVerifier(settings.tee), clock=lambda: TDX_AT)
    app = build(settings, start_audit_log(settings), tee=tee)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline, "the start-up sequence never ended"
            time.sleep(0.02)
        yield client


def test_the_real_tdx_quote_through_cpu_trust_dir_fails_only_its_report_data_binding(
    tmp_path: Path, smollm2_dir: Path, gpus: SyntheticGpuSetup
) -> None:
    settings = _settings(tmp_path, smollm2_dir, gpus)
    for client in _serve(settings, gpus):
        health = client.get("/health")
        assert (health.status_code, health.headers["x-inferno-tee"]) == (503, "FAILED")
        shown = client.get("/v1/attestation", params={"nonce": "11" * 32}).json()
        verdict = shown["standing_verdict"]
        assert [check["name"] for check in verdict["failed"]] == ["tdx.report_data"]
        passed = {check["name"] for check in verdict["checks"] if check["passed"]}
        # DCAP verification under the built-in Intel root passed; after a failed mechanism
        # step no policy check runs (attestation.cpu.verify).
        assert {"tdx.quote", "gpu0.signature", "gpu0.measurements"} <= passed


def test_the_gate_passes_the_real_tdx_quote_trusted_through_cpu_trust_dir(
    tmp_path: Path,
    smollm2_dir: Path,
    gpus: SyntheticGpuSetup,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "appliance.attestation.devices.report_data_v2", lambda *_: DCAP_REPORT_DATA
    )  # the quote's own report_data (module docstring: what is not exercised)
    monkeypatch.setattr(
        LoadedModel, "load", lambda config, preload: LoadedModel(engine, "sha256:" + "00" * 32)
    )
    settings = _settings(tmp_path, smollm2_dir, gpus)
    for client in _serve(settings, gpus):
        health = client.get("/health")
        assert health.status_code == 200, health.json()
        assert health.headers["x-inferno-tee"] == "VERIFIED"
        shown = client.get("/v1/attestation", params={"nonce": "11" * 32}).json()
        claims = shown["standing_verdict"]["claims"]["cpu"]
        assert (claims["tcb_status"], claims["mr_td"]) == ("UpToDate", DCAP_MR_TD)
