"""The real collection and verification of appliance.attestation.devices over synthetic
devices: the binding of the CPU report to the challenge, the GPU evidence and the attestation
key; the policy read fail-closed; and the NVML and configfs-tsm edges driven through emulated
drivers (the GPU and CPU helpers' fakes)."""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from appliance.attestation.challenge import gpu_nonces
from appliance.attestation.devices import (
    ConfigfsTsmCpu,
    EvidenceCollection,
    NvmlGpus,
    OfflineVerifier,
)
from appliance.attestation.service import TeeService
from appliance.config import TeeSettings
from appliance.trust_store import TrustStore
from attestation.binding import Channel, report_data_v2
from attestation.cpu import verify_cpu_evidence
from attestation.errors import CollectionError
from attestation.gpu import gpu_evidence_digest
from attestation.trust_bundle import TrustBundleId
from tests.appliance.attestation.synthetic_tee import SyntheticCpu, SyntheticGpus, write_policy
from tests.attestation.cpu.synthetic import FakeConfigfsTsm, SyntheticSnp
from tests.attestation.gpu.synthetic import SyntheticGpuSetup, synthetic_gpu_setup
from tests.attestation.gpu.test_nvml import FakeNvml
from tests.attestation.trust_bundles import build_trust_bundle, make_release_key

CHALLENGE = bytes(range(32))
KEY = bytes(range(100, 132))
CHANNEL = Channel(bytes(range(200, 232)), "inferno.test/devices+01020304+AAAA")


@pytest.fixture(scope="module")
def gpus(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGpuSetup:
    return synthetic_gpu_setup(tmp_path_factory.mktemp("gpus"), num_gpus=2)


@pytest.fixture(scope="module")
def snp() -> SyntheticSnp:
    return SyntheticSnp.create()


def _tee_settings(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, directory: Path, policy: dict[str, Any]
) -> TeeSettings:
    return TeeSettings(
        mode="required",
        policy_file=write_policy(directory / "policy.toml", policy),
        gpu_rims_dir=gpus.rim_dir,
        gpu_roots_dir=gpus.roots_dir,
        cpu_trust_dir=snp.write_trust_directory(directory / "cpu"),
    )


def test_the_cpu_report_binds_challenge_gpu_evidence_key_and_channel(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp
) -> None:
    evidence = EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)).collect(
        CHALLENGE, KEY, CHANNEL
    )
    assert [item.nonce for item in evidence.gpu] == gpu_nonces(CHALLENGE, 2)
    assert evidence.gpu_evidence_digest == gpu_evidence_digest(evidence.gpu)
    bound = report_data_v2(CHALLENGE, gpu_evidence_digest(evidence.gpu), KEY, CHANNEL)
    assert evidence.report_data == bound
    verdict = verify_cpu_evidence(
        evidence.cpu,
        expected_report_data=bound,
        policy=snp.policy(),
        trust=snp.trust(),
        at=datetime.now(UTC),
    )
    assert verdict.trusted, verdict.failures


def test_the_offline_verifier_passes_genuine_devices_with_gpu_and_cpu_checks(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path
) -> None:
    settings = _tee_settings(gpus, snp, tmp_path, {"gpu": gpus.policy_table(),
                                                   "snp": snp.policy_table()})  # fmt: skip
    tee = TeeService(
        "required",
        EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
        OfflineVerifier(settings),
    )
    attestation = asyncio.run(tee.attest("boot"))
    assert attestation.verdict.trusted, attestation.verdict.failures
    names = {check.name for check in attestation.verdict.checks}
    assert {"gpu0.nonce", "gpu1.nonce", "snp.policy.debug"} <= names
    assert set(attestation.verdict.claims) == {"gpu", "cpu", "collateral"}
    assert attestation.verdict.claims["collateral"] == {"trust_bundle": None}


def test_gpu_evidence_spliced_from_another_collection_fails_the_cpu_binding(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path
) -> None:
    """Another machine's (or another moment's) GPU evidence, with valid signatures for this
    challenge's nonces, next to this CPU report: the report_data no longer matches."""
    settings = _tee_settings(gpus, snp, tmp_path, {"gpu": gpus.policy_table(),
                                                   "snp": snp.policy_table()})  # fmt: skip
    collection = EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp))
    evidence = collection.collect(CHALLENGE, KEY, CHANNEL)
    other = gpus.collect(gpu_nonces(CHALLENGE, 2))  # ECDSA: fresh signatures, other bytes
    spliced = type(evidence)(CHALLENGE, KEY, tuple(other), evidence.cpu,
                             evidence.gpu_evidence_digest, evidence.report_data)  # fmt: skip
    verdict = OfflineVerifier(settings).verify(spliced, at=datetime.now(UTC))
    assert gpu_evidence_digest(other) != evidence.gpu_evidence_digest
    assert {check.name for check in verdict.failures} == {"snp.report_data"}, verdict.failures


@pytest.mark.parametrize(
    ("with_gpu_table", "reason"),
    [
        (False, "is empty: an empty policy never passes"),
        (True, "neither an [snp] nor a [tdx] table"),
    ],
    ids=["empty", "no-cpu-table"],
)
def test_a_policy_that_cannot_judge_the_evidence_fails_the_verdict(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path, with_gpu_table: bool, reason: str
) -> None:
    policy = {"gpu": gpus.policy_table()} if with_gpu_table else {}
    settings = _tee_settings(gpus, snp, tmp_path, policy)
    tee = TeeService(
        "required",
        EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
        OfflineVerifier(settings),
    )
    attestation = asyncio.run(tee.attest("boot"))
    [check] = attestation.verdict.checks
    assert (check.name, check.passed) == ("verify", False)
    assert reason in check.detail
    assert tee.state() == "FAILED"


@pytest.fixture
def configfs(snp: SyntheticSnp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    fake = FakeConfigfsTsm(tmp_path / "tsm" / "report", snp)
    with fake.installed(monkeypatch):
        yield fake.root


def test_the_nvml_and_configfs_tsm_sources_collect_a_bound_report(
    snp: SyntheticSnp, configfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(num_gpus=2))
    collection = EvidenceCollection(NvmlGpus(), ConfigfsTsmCpu(configfs))
    evidence = collection.collect(CHALLENGE, KEY, CHANNEL)
    assert [item.nonce for item in evidence.gpu] == gpu_nonces(CHALLENGE, 2)
    assert evidence.report_data == report_data_v2(
        CHALLENGE, gpu_evidence_digest(evidence.gpu), KEY, CHANNEL
    )
    verdict = verify_cpu_evidence(
        evidence.cpu,
        expected_report_data=evidence.report_data,
        policy=snp.policy(),
        trust=snp.trust(),
        at=datetime.now(UTC),
    )
    assert verdict.trusted, verdict.failures


def test_gpus_with_cc_off_fail_the_boot_with_that_reason(
    snp: SyntheticSnp, configfs: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(num_gpus=1, cc_on=False))
    collection = EvidenceCollection(NvmlGpus(), ConfigfsTsmCpu(configfs))

    class Unused:
        def verify(self, evidence: object, *, at: datetime) -> None:
            raise AssertionError("nothing to verify when nothing was collected")

    tee = TeeService("required", collection, Unused())  # type: ignore[arg-type]
    attestation = asyncio.run(tee.attest("boot"))
    assert attestation.evidence is None
    assert attestation.summary().startswith("collect: ")
    assert "confidential computing is off" in attestation.summary()


def test_no_configfs_tsm_fails_the_boot_with_that_reason(
    gpus: SyntheticGpuSetup, tmp_path: Path
) -> None:
    collection = EvidenceCollection(SyntheticGpus(gpus), ConfigfsTsmCpu(tmp_path / "absent"))
    with pytest.raises(CollectionError, match="configfs-tsm is not available"):
        collection.collect(CHALLENGE, KEY, CHANNEL)


def test_missing_nvml_bindings_are_a_collection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(CollectionError, match="install nvidia-ml-py"):
        NvmlGpus().num_gpus()


def test_a_wedged_driver_cannot_hang_the_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(num_gpus=1, hang_s=2.0))
    with pytest.raises(CollectionError, match="did not tell the number of GPUs"):
        NvmlGpus(timeout_s=0.1).num_gpus()


# ---- collateral from a trust store (tee.trust_dir, appliance/trust_store.py) ---------------

WEEK_S = 7 * 86400


@pytest.fixture(scope="module")
def release_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_release_key(tmp_path_factory.mktemp("release"))


def _trust_store_settings(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, directory: Path, release_key: tuple[Path, Path]
) -> TeeSettings:
    policy = {"gpu": gpus.policy_table(), "snp": snp.policy_table(),
              "collateral": {"max_age_s": WEEK_S}}  # fmt: skip
    return TeeSettings(
        mode="required",
        policy_file=write_policy(directory / "policy.toml", policy),
        gpu_roots_dir=gpus.roots_dir,
        trust_dir=directory / "trust",
        trust_release_key=release_key[1],
    )


def _install(
    settings: TeeSettings,
    gpus: SyntheticGpuSetup,
    snp: SyntheticSnp,
    release_key: tuple[Path, Path],
    age: timedelta,
) -> TrustBundleId:
    """Build a trust bundle of the synthetic devices' RIMs and CPU collateral, gathered `age`
    ago, and install it as `inferno trust update` does."""
    directory = Path(tempfile.mkdtemp(dir=settings.trust_dir.parent))  # type: ignore[union-attr]
    created = datetime.now(UTC).replace(microsecond=0) - age
    bundle = build_trust_bundle(
        directory / "bundle", release_key[0], created,
        gpu_rims=gpus.rim_dir, cpu_trust=snp.write_trust_directory(directory / "cpu"),
    )  # fmt: skip
    store = TrustStore.from_settings(settings)
    assert store is not None
    return store.update(bundle, lambda new, replaced: None).id


def test_a_fresh_trust_bundle_passes_and_the_verdict_names_it(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path, release_key: tuple[Path, Path]
) -> None:
    settings = _trust_store_settings(gpus, snp, tmp_path, release_key)
    installed = _install(settings, gpus, snp, release_key, timedelta(days=1))
    tee = TeeService("required", EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
                     OfflineVerifier(settings))  # fmt: skip
    verdict = asyncio.run(tee.attest("boot")).verdict
    assert verdict.trusted, verdict.failures
    [age] = [check for check in verdict.checks if check.name == "collateral.age"]
    assert age.passed
    assert re.search(r"is 1 day old \(864\d\d s\); the policy allows 7 days", age.detail)
    assert verdict.claims["collateral"] == {"trust_bundle": installed.to_json()}
    assert {"gpu0.rim.driver", "snp.policy.revocation"} <= {c.name for c in verdict.checks}


def test_a_stale_trust_bundle_fails_collateral_naming_its_age(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path, release_key: tuple[Path, Path]
) -> None:
    settings = _trust_store_settings(gpus, snp, tmp_path, release_key)
    installed = _install(settings, gpus, snp, release_key, timedelta(days=16))
    tee = TeeService("required", EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
                     OfflineVerifier(settings))  # fmt: skip
    attestation = asyncio.run(tee.attest("boot"))
    [failed] = attestation.verdict.failures
    assert failed.name == "collateral.age"
    assert failed.detail.startswith(f"trust bundle {installed.digest[:16]}… created ")
    allowed = r"the policy allows 7 days \(max_age_s = 604800\)$"
    assert re.search(r"is 16 days old \(13824\d\d s\); " + allowed, failed.detail)
    assert attestation.summary().startswith("collateral.age: trust bundle ")
    assert tee.state() == "FAILED"


def test_an_update_is_used_from_the_next_attestation_without_a_restart(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path, release_key: tuple[Path, Path]
) -> None:
    settings = _trust_store_settings(gpus, snp, tmp_path, release_key)
    stale = _install(settings, gpus, snp, release_key, timedelta(days=16))
    collection = EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp))
    verifier = OfflineVerifier(settings)
    before = verifier.verify(collection.collect(CHALLENGE, KEY, CHANNEL), at=datetime.now(UTC))
    assert not before.trusted
    fresh = _install(settings, gpus, snp, release_key, timedelta(hours=2))
    after = verifier.verify(collection.collect(CHALLENGE, KEY, CHANNEL), at=datetime.now(UTC))
    assert after.trusted, after.failures
    assert before.claims["collateral"]["trust_bundle"]["digest"] == stale.digest
    assert after.claims["collateral"]["trust_bundle"]["digest"] == fresh.digest


def test_an_installed_bundle_changed_on_disk_fails_the_verdict(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path, release_key: tuple[Path, Path]
) -> None:
    settings = _trust_store_settings(gpus, snp, tmp_path, release_key)
    installed = _install(settings, gpus, snp, release_key, timedelta(days=1))
    rim = next((tmp_path / "trust" / installed.digest / "gpu" / "rims").iterdir())
    rim.write_bytes(rim.read_bytes().replace(b"550.90.07", b"550.90.08"))
    tee = TeeService("required", EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
                     OfflineVerifier(settings))  # fmt: skip
    [check] = asyncio.run(tee.attest("boot")).verdict.checks
    assert (check.name, check.passed) == ("verify", False)
    assert check.detail.endswith("has the wrong SHA-256 (the file was modified)")


def test_collateral_from_the_legacy_directories_fails_a_policy_with_a_maximum_age(
    gpus: SyntheticGpuSetup, snp: SyntheticSnp, tmp_path: Path
) -> None:
    policy = {"gpu": gpus.policy_table(), "snp": snp.policy_table(),
              "collateral": {"max_age_s": WEEK_S}}  # fmt: skip
    settings = _tee_settings(gpus, snp, tmp_path, policy)
    tee = TeeService("required", EvidenceCollection(SyntheticGpus(gpus), SyntheticCpu(snp)),
                     OfflineVerifier(settings))  # fmt: skip
    verdict = asyncio.run(tee.attest("boot")).verdict
    [failed] = verdict.failures
    assert failed.name == "collateral.age"
    assert failed.detail.startswith("no dated trust bundle")
    assert verdict.claims["collateral"] == {"trust_bundle": None}
