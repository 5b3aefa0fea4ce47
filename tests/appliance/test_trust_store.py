"""`inferno trust update` (appliance/trust_store.py): a bundle the release key signed is
recorded in the audit log, then installed and switched to; every refused bundle exits 2 with
one line naming its defect, records nothing and leaves the store exactly as it was."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import tarfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from appliance.__main__ import main
from appliance.boot.audit_log import open_audit_log
from appliance.config import AuditSettings, load_section
from audit.errors import AuditError
from audit.log import AuditLog
from tests.attestation.trust_bundles import build_trust_bundle, make_release_key

CREATED = datetime(2026, 11, 10, tzinfo=UTC)
RIM = "gpu/rims/NV_GPU_DRIVER_GH100_550.90.07.swidtag"


class Site:
    """A release key, collateral to bundle, and an appliance's settings naming a trust store."""

    def __init__(self, directory: Path, **tee: str | None) -> None:
        self.directory = directory
        self.key, self.public_key = make_release_key(directory / "keys")
        self.rims = directory / "rims"
        self.rims.mkdir()
        (self.rims / Path(RIM).name).write_bytes(b"<rim/>")
        self.trust_dir = directory / "trust"
        self.config = directory / "inferno.toml"
        tee_lines = {
            "policy_file": "policy.toml",
            "trust_dir": "trust",
            "trust_release_key": "keys/release-key.pub",
            **tee,
        }
        self.config.write_text(
            '[model]\ndir = "models/not-yet-converted"\n'
            '[audit]\norigin = "inferno.test/trust"\ndata_dir = "audit"\n'
            "[tee]\n"
            + "".join(f'{name} = "{value}"\n' for name, value in tee_lines.items() if value)
        )

    def bundle(self, name: str, created: datetime = CREATED, *, tar: bool = False) -> Path:
        return build_trust_bundle(
            self.directory / name, self.key, created, gpu_rims=self.rims, tar=tar
        )

    def update(self, bundle: Path) -> int:
        return main(["trust", "update", str(bundle), "--config", str(self.config)])

    def state(self) -> dict[str, str]:
        """Every path in the store with its content's digest or its link's target."""
        found: dict[str, str] = {}
        if not self.trust_dir.exists():
            return found
        for path in sorted(self.trust_dir.rglob("*")):
            relative = path.relative_to(self.trust_dir).as_posix()
            if path.is_symlink():
                found[relative] = "-> " + os.readlink(path)
            elif path.is_file() and relative != ".lock":
                found[relative] = path.read_bytes().hex()[:16]
        return found

    def updates(self) -> list[dict[str, Any]]:
        audit = load_section(self.config, AuditSettings)
        with open_audit_log(audit) as log:
            entries = [json.loads(leaf) for _, leaf in log.store.entries(0, log.store.size() - 1)]
        return [e for e in entries if e["action"] == "admin.trust.update"]


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def _digest(bundle: Path) -> str:
    return hashlib.sha256((bundle / "MANIFEST.json").read_bytes()).hexdigest()


def test_an_update_is_recorded_then_installed_and_current_switches_to_it(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = site.bundle("b1")
    assert site.update(bundle) == 0
    digest = _digest(bundle)
    assert (
        f"installed trust bundle {digest} (created 2026-11-10T00:00:00Z)" in capsys.readouterr().out
    )
    assert os.readlink(site.trust_dir / "current") == digest
    assert (site.trust_dir / digest / RIM).read_bytes() == b"<rim/>"
    # Readable by the appliance's service user, writable only by who installed it.
    assert (site.trust_dir / digest).stat().st_mode & 0o777 == 0o755
    assert (site.trust_dir / digest / RIM).stat().st_mode & 0o777 == 0o644
    [entry] = site.updates()
    assert entry["outcome"] == "success"
    assert entry["details"]["target"] == {
        "trust_bundle": digest,
        "created": "2026-11-10T00:00:00Z",
        "replaces": None,
    }
    assert entry["actor"]["subject"] == pwd.getpwuid(os.geteuid()).pw_name
    assert entry["actor"]["client"] == "inferno trust update"


def test_a_newer_bundle_replaces_the_current_one_and_the_one_before_is_kept(site: Site) -> None:
    bundles = [site.bundle(f"b{i}", CREATED + timedelta(days=i)) for i in range(3)]
    for bundle in bundles:
        assert site.update(bundle) == 0
    digests = [_digest(bundle) for bundle in bundles]
    assert os.readlink(site.trust_dir / "current") == digests[2]
    kept = {p.name for p in site.trust_dir.iterdir() if not p.name.startswith(".")}
    assert kept == {"current", digests[1], digests[2]}
    assert [e["details"]["target"]["replaces"] for e in site.updates()] == [None, *digests[:2]]


def test_a_tar_installs_like_the_directory(site: Site) -> None:
    assert site.update(site.bundle("b1", tar=True)) == 0
    assert os.readlink(site.trust_dir / "current") == _digest(site.directory / "b1")


def _modified(site: Site, bundle: Path) -> Path:
    (bundle / RIM).write_bytes(b"<rim forged/>")
    return bundle


def _added(site: Site, bundle: Path) -> Path:
    (bundle / "gpu" / "rims" / "added.swidtag").write_bytes(b"<rim/>")
    return bundle


def _removed(site: Site, bundle: Path) -> Path:
    (bundle / RIM).unlink()
    return bundle


def _other_key(site: Site, bundle: Path) -> Path:
    key, _ = make_release_key(site.directory / "other-keys")
    shutil.rmtree(bundle)
    return build_trust_bundle(bundle, key, CREATED + timedelta(days=1), gpu_rims=site.rims)


def _symlink(site: Site, bundle: Path) -> Path:
    (bundle / RIM).unlink()
    os.symlink(site.rims / Path(RIM).name, bundle / RIM)
    return bundle


def _traversal_in_tar(site: Site, bundle: Path) -> Path:
    tar_path = site.directory / "evil.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(bundle / "MANIFEST.json", arcname="MANIFEST.json")
        tar.add(bundle / RIM, arcname="gpu/rims/../../../../escaped.swidtag")
    return tar_path


def _truncated_tar(site: Site, bundle: Path) -> Path:
    (site.rims / "big.swidtag").write_bytes(os.urandom(200_000))
    tar_path = site.bundle("big", CREATED + timedelta(days=1), tar=True)
    tar_path.write_bytes(tar_path.read_bytes()[:150_000])
    return tar_path


def _older(site: Site, bundle: Path) -> Path:
    return site.bundle("older", CREATED - timedelta(days=1))


def _same_date(site: Site, bundle: Path) -> Path:
    (site.rims / "another.swidtag").write_bytes(b"<rim 2/>")
    return site.bundle("same-date", CREATED)


TAMPERED = {
    "modified-file": (_modified, f"{RIM} has the wrong SHA-256 (the file was modified)"),
    "added-file": (_added, "gpu/rims/added.swidtag is not in the manifest (a file was added)"),
    "removed-file": (_removed, f"{RIM} is in the manifest but missing (a file was removed)"),
    "other-key": (_other_key, "MANIFEST.sig does not verify against the release key"),
    "symlink": (_symlink, f"{RIM} is a symbolic link; a bundle holds none"),
    "path-traversal-in-tar": (
        _traversal_in_tar,
        "evil.tar: 'gpu/rims/../../../../escaped.swidtag' is not a file of the trust bundle",
    ),
    "truncated-tar": (_truncated_tar, "big.tar is truncated"),
    "older-than-installed": (
        _older,
        "the bundle was created 2026-11-09T00:00:00Z, not after the installed one "
        "(2026-11-10T00:00:00Z",
    ),
    "same-date-as-installed": (_same_date, "not after the installed one"),
}


@pytest.mark.parametrize("defect", TAMPERED)
def test_a_refused_bundle_exits_2_with_one_line_and_changes_nothing(
    site: Site, capsys: pytest.CaptureFixture[str], defect: str
) -> None:
    assert site.update(site.bundle("installed")) == 0
    before, recorded = site.state(), site.updates()
    capsys.readouterr()
    make, reason = TAMPERED[defect]
    candidate = make(site, site.bundle("candidate", CREATED + timedelta(days=1)))
    assert site.update(candidate) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("inferno: error: trust bundle refused: "), err
    assert reason in err
    assert site.state() == before
    assert site.updates() == recorded
    assert not (site.directory / "escaped.swidtag").exists()


def test_an_update_the_audit_log_cannot_record_does_not_happen(
    site: Site, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(self: AuditLog, event: object) -> None:
        raise AuditError("the audit database is read-only")

    monkeypatch.setattr(AuditLog, "append", refuse)
    assert site.update(site.bundle("b1")) == 2
    assert "the audit database is read-only" in capsys.readouterr().err
    assert site.state() == {}


def test_an_installed_bundle_changed_on_disk_blocks_updates_until_removed(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    assert site.update(site.bundle("b1")) == 0
    current = site.trust_dir / "current"
    (current / RIM).write_bytes(b"<rim changed in place/>")
    assert site.update(site.bundle("b2", CREATED + timedelta(days=1))) == 2
    assert "the installed trust bundle does not verify" in capsys.readouterr().err
    current.unlink()
    assert site.update(site.directory / "b2") == 0


def test_settings_naming_both_a_trust_store_and_the_legacy_directories_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = Site(tmp_path, gpu_rims_dir="rims", cpu_trust_dir="cpu")
    assert site.update(site.bundle("b1")) == 2
    err = capsys.readouterr().err
    assert "tee.trust_dir and tee.gpu_rims_dir, tee.cpu_trust_dir are both set" in err


def test_settings_without_a_trust_store_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = Site(tmp_path, trust_dir=None, trust_release_key=None, gpu_rims_dir="rims")
    assert site.update(site.bundle("b1")) == 2
    assert "tee.trust_dir is not set" in capsys.readouterr().err


def test_a_store_that_cannot_be_written_is_one_line_not_a_traceback(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    site.trust_dir.write_text("a file where the store should be")
    assert site.update(site.bundle("b1")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"inferno: error: the trust store {site.trust_dir} cannot be updated: ")
    assert site.updates() == []
