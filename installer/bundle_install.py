"""The bundle's standalone installer: copied into every bundle as `install.py`.

    python3 BUNDLE/install.py --release-key-pub FILE --prefix DIR --no-systemd [--from-tar TAR]

It runs on the air-gapped host with nothing but the Python standard library: the Ed25519
signature check (RFC 8032, section 5.1.7) is written out below in pure Python, so no code from
the bundle (not even `cryptography` from its wheelhouse) runs before the bundle is verified.
This file is itself in the signed manifest, but whoever runs it trusts it: compare its SHA-256
with the one published beside the release key (docs/INSTALL.md).

The plan, every step before anything is written under DIR:
 1. Copy the bundle into a private temporary directory (from the directory holding this file,
    or, with `--from-tar`, from a tar whose members are checked first: regular files and
    directories only, relative names that stay inside). Symbolic links, devices and other
    special files are refused, wherever they point.
 2. Verify MANIFEST.sig over MANIFEST.json's exact bytes against the release key given out of
    band; only then parse the manifest (bounded size, a flat fixed shape).
 3. Check every manifest path stays inside the bundle, and that the copy holds exactly the
    manifest's files, each with its size and SHA-256.
 4. Check that this host is the bundle's target: Linux, x86_64, the Python its wheels are for.
Then it installs from the verified copy: a virtual environment in DIR/releases/<version>
(`python3 -m venv`, `pip install --no-index` from the bundle's wheelhouse, pip's own
configuration ignored), the models beside it, DIR/etc/inferno.toml from the template when none
exists, and finally the link DIR/current, switched atomically. A failure removes what it made.

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


# ---- the install -------------------------------------------------------------------------


def install(bundle: Path, manifest: Manifest, prefix: Path) -> Path:
    """Install a verified bundle into `prefix`; returns the `inferno` command's path."""
    release = prefix / "releases" / manifest.version
    if release.exists() or release.is_symlink():
        raise InstallFailed(f"{release} already exists: this version is installed")
    made = [p for p in (prefix, prefix / "releases", prefix / "etc") if not p.exists()]
    config = prefix / "etc" / "inferno.toml"
    wrote_config = False
    try:
        (prefix / "releases").mkdir(parents=True, exist_ok=True)
        _make_venv(bundle, release)
        for entry in manifest.files:
            if entry.path.startswith("models/"):
                target = release / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(bundle / entry.path, target)
        if not config.exists():
            (prefix / "etc").mkdir(exist_ok=True)
            template = (bundle / CONFIG_TEMPLATE).read_text(encoding="utf-8")
            _write_atomically(config, template.replace("@PREFIX@", str(prefix.resolve())))
            wrote_config = True
        link_tmp = prefix / ".current.new"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(Path("releases") / manifest.version, link_tmp)
        os.replace(link_tmp, prefix / "current")
    except BaseException:
        shutil.rmtree(release, ignore_errors=True)
        if wrote_config:
            config.unlink(missing_ok=True)
        (prefix / ".current.new").unlink(missing_ok=True)
        for path in reversed(made):
            shutil.rmtree(path, ignore_errors=True)
        raise
    return prefix / "current" / "bin" / "inferno"


def _make_venv(bundle: Path, release: Path) -> None:
    # A venv bakes its absolute path into its scripts, so it is made in place (never renamed).
    # Only the wheelhouse counts: this host's pip configuration and PIP_* variables are ignored,
    # and so are PYTHON* variables and the user's site-packages (-I), through which pip would
    # see some other `inferno` as already installed.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    wheels = str(bundle / "wheels")
    steps = [
        ("python3 -m venv", [sys.executable, "-I", "-m", "venv", str(release)]),
        (
            "pip install --no-index",
            [
                *(str(release / "bin" / "python"), "-I", "-m", "pip", "install", "--quiet"),
                *("--disable-pip-version-check", "--no-cache-dir", "--no-index"),
                *("--find-links", wheels, "inferno"),
            ],
        ),
    ]
    for label, command in steps:
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
            raise InstallFailed(f"{label} failed: {last[-1]}")


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--release-key-pub", required=True, type=Path, help="Ed25519 PEM")
    parser.add_argument("--prefix", required=True, type=Path, help="where releases/ goes")
    parser.add_argument(
        "--no-systemd",
        action="store_true",
        help="install without a service (the only mode this installer has so far)",
    )
    parser.add_argument("--from-tar", type=Path, help="install from this bundle tar instead")
    args = parser.parse_args(argv)
    if not args.no_systemd:
        print(
            "install.py: installing the systemd service is not supported yet: pass --no-systemd",
            file=sys.stderr,
        )
        return 64
    try:
        public_key = parse_public_key_pem(args.release_key_pub.read_text(encoding="ascii"))
        with tempfile.TemporaryDirectory(prefix="inferno-bundle-") as tmp:
            copy = Path(tmp) / "bundle"
            copy.mkdir(mode=0o700)
            if args.from_tar is not None:
                extract_bundle_tar(args.from_tar, copy)
            else:
                copy_bundle_dir(Path(__file__).resolve().parent, copy)
            manifest = verify_bundle(copy, public_key)
            check_host(manifest)
            command = install(copy, manifest, args.prefix.absolute())
    except (BundleRefused, OSError, UnicodeDecodeError) as exc:
        print(f"install.py: refused: {exc}", file=sys.stderr)
        return 2
    except InstallFailed as exc:
        print(f"install.py: install failed, nothing kept: {exc}", file=sys.stderr)
        return 2
    print(f"installed inferno {manifest.version} ({manifest.target}) into {args.prefix}")
    print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
