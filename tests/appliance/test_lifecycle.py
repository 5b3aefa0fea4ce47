"""`inferno config check` and `inferno admin record-install`, the commands install.py runs with a
release before switching to it (tests/installer/test_lifecycle.py runs them installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.__main__ import main
from appliance.boot.audit_log import open_audit_log
from appliance.config import AuditSettings, load_section

DIGEST = "ab" * 32


def _audit_only(tmp_path: Path) -> Path:
    """A production template's settings: an `[audit]`, and no identity provider yet."""
    config = tmp_path / "inferno.toml"
    config.write_text('[audit]\norigin = "inferno.test/audit"\ndata_dir = "audit"\n')
    return config


def test_config_check_names_every_setting_a_release_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _audit_only(tmp_path)
    config.write_text(config.read_text() + "[limits]\nsubject_max_concurrent_requests = 0\n")
    assert main(["config", "check", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "limits.subject_max_concurrent_requests: Input should be greater than" in err
    assert "model: required" in err and "auth: required" in err


def test_record_install_appends_the_admin_action_with_version_digest_and_who(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _audit_only(tmp_path)
    argv = ["admin", "record-install", "--config", str(config), "--bundle-digest", DIGEST]
    assert main([*argv, "--action", "install", "--version", "0.1.0", "--who", "alice"]) == 0
    upgrade = ["--action", "upgrade", "--version", "0.2.0", "--previous", "0.1.0"]
    assert main([*argv, *upgrade, "--who", "bob"]) == 0
    with open_audit_log(load_section(config, AuditSettings)) as log:
        entries = [json.loads(leaf) for _, leaf in log.store.entries(0, log.store.size() - 1)]
    assert [e["action"] for e in entries] == ["admin.install", "admin.upgrade"]
    assert entries[1]["actor"]["subject"] == "bob"
    assert entries[1]["actor"]["client"] == "install.py"
    assert entries[1]["details"]["target"] == {
        "version": "0.2.0",
        "previous_version": "0.1.0",
        "bundle_digest": f"sha256:{DIGEST}",
        "who": "bob",
    }
    capsys.readouterr()


@pytest.mark.parametrize(
    ("option", "value"), [("--bundle-digest", "AB" * 32), ("--version", "../1"), ("--who", "a\nb")]
)
def test_record_install_refuses_malformed_arguments_and_appends_nothing(
    tmp_path: Path, option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _audit_only(tmp_path)
    args = {"--bundle-digest": DIGEST, "--version": "0.1.0", "--who": "alice", option: value}
    argv = ["admin", "record-install", "--config", str(config), "--action", "install"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, *(item for pair in args.items() for item in pair)])
    assert exited.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
    assert not (tmp_path / "audit").exists()


def test_record_install_refuses_a_config_without_an_audit_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "inferno.toml"
    config.write_text('[model]\ndir = "m"\n')
    argv = ["admin", "record-install", "--config", str(config), "--action", "install"]
    argv += ["--version", "0.1.0", "--bundle-digest", DIGEST, "--who", "alice"]
    assert main(argv) == 2
    assert "audit.origin: required" in capsys.readouterr().err
