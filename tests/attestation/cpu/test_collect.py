"""configfs-tsm collection against an emulated provider (FakeConfigfsTsm): the report binds the
caller's report_data and carries the certificate table; the entry is removed afterwards; an
absent configfs-tsm, a racing writer or an unknown provider is a CollectionError."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.cpu import collect_cpu_evidence, verify_cpu_evidence
from attestation.cpu.snp import SnpReport
from attestation.errors import CollectionError
from tests.attestation.cpu.synthetic import FakeConfigfsTsm, SyntheticSnp

REPORT_DATA = bytes(range(64))


@pytest.fixture(scope="module")
def platform() -> SyntheticSnp:
    return SyntheticSnp.create()


def test_collected_report_binds_report_data_and_verifies(
    platform: SyntheticSnp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeConfigfsTsm(tmp_path / "report", platform)
    with fake.installed(monkeypatch):
        evidence = collect_cpu_evidence(REPORT_DATA, tsm_root=fake.root)
    assert evidence.kind == "snp"
    assert evidence.provider == "sev_guest"
    assert SnpReport.parse(evidence.report).report_data == REPORT_DATA
    assert list(fake.root.iterdir()) == []  # the entry was removed
    verdict = verify_cpu_evidence(
        evidence,
        expected_report_data=REPORT_DATA,
        policy=platform.policy(),
        trust=platform.trust(),
        at=datetime.now(UTC),
    )
    assert verdict.trusted, verdict.failures


def test_absent_configfs_tsm_says_so(tmp_path: Path) -> None:
    with pytest.raises(CollectionError, match="configfs-tsm is not available"):
        collect_cpu_evidence(REPORT_DATA, tsm_root=tmp_path / "missing")


def test_racing_writer_is_refused_after_retries(
    platform: SyntheticSnp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeConfigfsTsm(tmp_path / "report", platform, race=True)
    with fake.installed(monkeypatch), pytest.raises(CollectionError, match="another writer"):
        collect_cpu_evidence(REPORT_DATA, tsm_root=fake.root)
    assert len(fake.entries_seen) == 3
    assert list(fake.root.iterdir()) == []


def test_unknown_provider_is_refused(
    platform: SyntheticSnp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeConfigfsTsm(tmp_path / "report", platform)
    real_read = fake.read
    monkeypatch.setattr(
        fake, "read", lambda p: b"arm_cca\n" if p.name == "provider" else real_read(p)
    )
    with fake.installed(monkeypatch), pytest.raises(CollectionError, match="unknown"):
        collect_cpu_evidence(REPORT_DATA, tsm_root=fake.root)


def test_entry_that_cannot_be_created_is_a_collection_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(CollectionError, match="cannot create configfs-tsm entry"):
        collect_cpu_evidence(REPORT_DATA, tsm_root=tmp_path)


def test_report_data_of_the_wrong_size_is_a_caller_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        collect_cpu_evidence(bytes(32), tsm_root=tmp_path)


def test_provider_that_never_answers_times_out_instead_of_hanging(
    platform: SyntheticSnp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeConfigfsTsm(tmp_path / "report", platform)
    release = threading.Event()
    real_read = fake.read

    def stuck(path: Path) -> bytes:
        if path.name == "outblob":
            release.wait(10)
        return real_read(path)

    monkeypatch.setattr(fake, "read", stuck)
    try:
        with fake.installed(monkeypatch), pytest.raises(CollectionError, match="did not answer"):
            collect_cpu_evidence(REPORT_DATA, tsm_root=fake.root, timeout_s=0.2)
    finally:
        release.set()
