"""Trust bundles for tests, made the way a release engineer makes them: the release key and
the bundle through `python -m installer` (installer/trust_bundle.py)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from attestation.trust_bundle import format_created
from installer.__main__ import main as installer_main


def make_release_key(directory: Path) -> tuple[Path, Path]:
    """`python -m installer release-key DIRECTORY`: the private PEM and the public key."""
    assert installer_main(["release-key", str(directory)]) == 0
    return directory / "release-key.pem", directory / "release-key.pub"


def build_trust_bundle(
    out: Path,
    release_key: Path,
    created: datetime,
    *,
    gpu_rims: Path | None = None,
    gpu_revocation: Path | None = None,
    cpu_trust: Path | None = None,
    tar: bool = False,
) -> Path:
    """`python -m installer trust-bundle OUT ...`; returns OUT (or OUT.tar with `tar`)."""
    argv = ["trust-bundle", str(out), "--release-key", str(release_key)]
    argv += ["--created", format_created(created)]
    for option, directory in (
        ("--gpu-rims", gpu_rims),
        ("--gpu-revocation", gpu_revocation),
        ("--cpu-trust", cpu_trust),
    ):
        if directory is not None:
            argv += [option, str(directory)]
    assert installer_main([*argv, "--tar"] if tar else argv) == 0
    return out.with_name(out.name + ".tar") if tar else out
