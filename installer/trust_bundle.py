"""`python -m installer trust-bundle`: the attestation collateral in a bundle signed by the
release key, for `inferno trust update` on the air-gapped appliance (attestation.trust_bundle
describes the format; docs/INSTALL.md, "Trust bundles").

    python -m installer trust-bundle OUT --release-key PEM --created RFC3339-UTC
        [--gpu-rims DIR] [--gpu-revocation DIR] [--cpu-trust DIR] [--tar]

`--created` is required and never defaults to the time of the build: it is the date the
collateral was gathered (when the OCSP responses, CRLs and Intel collateral were fetched), and
the appliance's policy judges the bundle's age from it. A date in the future is refused. The
bundle is built in a temporary sibling of OUT, checked by the appliance's own verifier, and
renamed at the end: OUT is whole or absent. The same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import shutil
import stat
from datetime import UTC, datetime
from pathlib import Path

from attestation.trust_bundle import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    ManifestEntry,
    check_layout_path,
    format_created,
    manifest_bytes,
    parse_created,
    verify_trust_bundle,
)
from installer.bundle import file_entries, load_release_key, staged_output, tar_path_of
from installer.errors import BundleError


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `trust-bundle` on the installer's command line."""
    build = commands.add_parser("trust-bundle", help="build a signed attestation trust bundle")
    build.add_argument("out", type=Path, help="the trust bundle directory to create")
    build.add_argument("--release-key", required=True, type=Path, help="Ed25519 PEM private key")
    build.add_argument(
        "--created",
        required=True,
        help="when the collateral was gathered, RFC 3339 UTC (2026-11-10T00:00:00Z): the "
        "appliance judges the bundle's age from it",
    )
    build.add_argument("--gpu-rims", type=Path, help="directory of NVIDIA RIMs (.swidtag/.xml)")
    build.add_argument("--gpu-revocation", type=Path, help="directory of .ocsp and .crl files")
    build.add_argument(
        "--cpu-trust", type=Path, help="CPU collateral in the layout of tee.cpu_trust_dir"
    )
    build.add_argument("--tar", action="store_true", help="also write OUT.tar")
    build.set_defaults(run=run_trust_bundle)


def run_trust_bundle(args: argparse.Namespace) -> int:
    created = parse_created(args.created, "--created")
    if created > datetime.now(UTC):
        raise BundleError(f"--created {args.created} is in the future: give when it was gathered")
    sources = [
        (args.gpu_rims, "gpu/rims", False),
        (args.gpu_revocation, "gpu/revocation", False),
        (args.cpu_trust, "cpu", True),
    ]
    if all(source is None for source, _, _ in sources):
        raise BundleError("nothing to bundle: give --gpu-rims, --gpu-revocation or --cpu-trust")
    key = load_release_key(args.release_key)
    out: Path = args.out
    with staged_output(out, tar=args.tar) as staging:
        for source, prefix, nested in sources:
            if source is not None:
                _copy_collateral(source, staging, prefix, nested=nested)
        entries = [ManifestEntry(e.path, e.sha256, e.size) for e in file_entries(staging)]
        manifest = manifest_bytes(created, entries)
        (staging / MANIFEST_NAME).write_bytes(manifest)
        (staging / SIGNATURE_NAME).write_bytes(key.sign(manifest))
        bundle = verify_trust_bundle(staging, key.public_key())
    print(
        f"wrote {out}" + (f" and {tar_path_of(out)}" if args.tar else "")
        + f": trust bundle {bundle.id.digest}, created {format_created(created)}, "
        f"{len(bundle.files)} files"
    )  # fmt: skip
    return 0


def _copy_collateral(source: Path, staging: Path, prefix: str, *, nested: bool) -> None:
    """Copy the regular files of `source` to `staging/prefix/`, each at a path of the bundle's
    layout; with `nested` the tree below `source`, else its files alone."""
    if source.is_symlink() or not source.is_dir():
        raise BundleError(f"{source} is not a directory")
    for path in sorted(source.rglob("*") if nested else source.iterdir()):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode) and nested:
            continue
        if not stat.S_ISREG(mode):
            raise BundleError(f"{path} is not a regular file: a trust bundle holds only those")
        relative = f"{prefix}/{path.relative_to(source).as_posix()}"
        check_layout_path(relative, f"{path}")
        target = staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
