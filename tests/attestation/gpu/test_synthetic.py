"""The synthetic GPU (tests/attestation/gpu/synthetic.py) is what end-to-end boot tests stand on:
its evidence must pass the real verifier when its roots are pinned, and only then."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.gpu import GpuTrust, verify_gpu_evidence
from tests.attestation.gpu.synthetic import SyntheticGpuSetup, synthetic_gpu_setup

NOW = datetime(2026, 11, 22, tzinfo=UTC)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> SyntheticGpuSetup:
    return synthetic_gpu_setup(tmp_path_factory.mktemp("gpu"), num_gpus=2)


def nonces(n: int = 2) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def test_synthetic_evidence_passes_under_its_pinned_roots(setup: SyntheticGpuSetup) -> None:
    expected = nonces()
    verdict = verify_gpu_evidence(
        setup.collect(expected),
        expected_nonces=expected,
        policy=setup.policy(),
        trust=setup.trust(),
        at=NOW,
    )
    assert verdict.trusted, verdict.failures
    gpu = verdict.claims["gpus"][1]
    assert gpu["driver_version"] == setup.driver_version
    assert gpu["num_measurements_compared"] == 33


def test_synthetic_evidence_fails_under_nvidia_roots(setup: SyntheticGpuSetup) -> None:
    expected = nonces()
    nvidia_trust = GpuTrust.from_paths(rim_dir=setup.rim_dir)
    verdict = verify_gpu_evidence(
        setup.collect(expected),
        expected_nonces=expected,
        policy=setup.policy(),
        trust=nvidia_trust,
        at=NOW,
    )
    assert not verdict.trusted
    assert {c.name for c in verdict.failures} == {
        "gpu0.certificate_chain",
        "gpu1.certificate_chain",
    }


@pytest.mark.parametrize(
    ("override", "failed_check"),
    [
        ({"driver_version": "999.99"}, "gpu0.policy.driver_version"),
        ({"vbios_version": "96.00.00.00.01"}, "gpu0.policy.vbios_version"),
        ({"dev_tools_mode": True}, "gpu0.policy.dev_tools"),
        ({"cc_mode": "off"}, "gpu0.policy.cc_mode"),
        ({"measurements": {5: bytes(48)}}, "gpu0.measurements"),
    ],
)
def test_synthetic_overrides_violate_policy_at_the_named_check(
    setup: SyntheticGpuSetup, override: dict, failed_check: str
) -> None:
    expected = nonces()
    verdict = verify_gpu_evidence(
        setup.collect(expected, **override),
        expected_nonces=expected,
        policy=setup.policy(),
        trust=setup.trust(),
        at=NOW,
    )
    assert failed_check in {c.name for c in verdict.failures}


def test_synthetic_report_for_another_nonce_fails_the_nonce_check(
    setup: SyntheticGpuSetup, tmp_path: Path
) -> None:
    expected = nonces()
    verdict = verify_gpu_evidence(
        setup.collect(nonces()),
        expected_nonces=expected,
        policy=setup.policy(),
        trust=setup.trust(),
        at=NOW,
    )
    assert {c.name for c in verdict.failures} == {"gpu0.nonce", "gpu1.nonce"}
