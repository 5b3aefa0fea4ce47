"""Trust bundles: the attestation collateral (RIMs, revocation snapshots, CPU collateral) in one
directory signed by the release key, so that an air-gapped appliance can take fresh collateral
without a new release (docs/ATTESTATION.md, "Trust bundles").

The layout, every file optional, each directory flat:

    MANIFEST.json                   {"created", "files": [{"path", "sha256", "size"}], "format"}
    MANIFEST.sig                    Ed25519 over MANIFEST.json's exact bytes (64 raw bytes)
    gpu/rims/<name>.swidtag|.xml    NVIDIA RIMs (attestation.gpu.trust)
    gpu/revocation/<name>.ocsp|.crl OCSP responses and CRLs for the GPU chains
    cpu/...                         the layout of attestation.cpu.trust.CpuTrust.load:
                                    snp/ark-<name>.pem, snp/certificates/<name>,
                                    snp/crl-<name>, tdx/root_ca.pem,
                                    tdx/collateral/<name>.json

`created` is when the collateral was gathered (RFC 3339, UTC, whole seconds): the staleness
check (attestation.collateral) judges the bundle's age from it. The manifest holds no other
time, and its files are sorted: the same inputs give the same bytes. A bundle's digest is the
SHA-256 of its MANIFEST.json.

Verification (`verify_trust_bundle`), in order, fail closed:
 1. Walk the directory without following links: only the layout's directories and file names,
    regular files only (a symbolic link is refused wherever it points), within MAX_FILES and
    MAX_FILE_BYTES.
 2. Check MANIFEST.sig over MANIFEST.json's exact bytes with the release key; nothing of an
    unsigned manifest is parsed.
 3. Parse the manifest (within MAX_MANIFEST_BYTES and the nesting limit of
    attestation.input_limits; exactly its fields; every path in the layout, listed once).
 4. The directory holds exactly the manifest's files (none added, none missing), each with its
    size and SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from attestation.errors import TrustBundleError
from attestation.input_limits import parse_json, read_file

FORMAT = "inferno-trust/1"
MANIFEST_NAME = "MANIFEST.json"
SIGNATURE_NAME = "MANIFEST.sig"
# NVIDIA publishes a few hundred RIMs in all, each under 100 KiB; Intel's collateral for one
# FMSPC is 16 KiB and a CRL of many revoked certificates a few MiB. The limits leave a wide
# margin and still bound what an update can make the appliance read.
MAX_FILES = 10_000
MAX_FILE_BYTES = 16 << 20
MAX_BUNDLE_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 4 << 20
MAX_PUBLIC_KEY_BYTES = 4096
_CHUNK = 1 << 20

# A file name of the layout: no leading dot (so never "." or ".."), no separator, bounded.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
LAYOUT = re.compile(
    rf"gpu/rims/{_NAME}\.(?:swidtag|xml)"
    rf"|gpu/revocation/{_NAME}\.(?:ocsp|crl)"
    rf"|cpu/snp/ark-{_NAME}\.pem"
    rf"|cpu/snp/certificates/{_NAME}"
    rf"|cpu/snp/crl-{_NAME}"
    r"|cpu/tdx/root_ca\.pem"
    rf"|cpu/tdx/collateral/{_NAME}\.json"
)
LAYOUT_DIRECTORIES = frozenset(
    {
        "gpu",
        "gpu/rims",
        "gpu/revocation",
        "cpu",
        "cpu/snp",
        "cpu/snp/certificates",
        "cpu/tdx",
        "cpu/tdx/collateral",
    }
)
_CREATED = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class TrustBundleId:
    """What names a verified bundle: the SHA-256 of its manifest (hex) and when its collateral
    was gathered (timezone-aware UTC)."""

    digest: str
    created: datetime

    def to_json(self) -> dict[str, str]:
        return {"digest": self.digest, "created": format_created(self.created)}


@dataclass(frozen=True, slots=True)
class TrustBundle:
    """A verified bundle in `root`: its id and its files."""

    root: Path
    id: TrustBundleId
    files: tuple[ManifestEntry, ...]

    @property
    def gpu_rims_dir(self) -> Path:
        return self.root / "gpu" / "rims"

    @property
    def gpu_revocation_dir(self) -> Path:
        return self.root / "gpu" / "revocation"

    @property
    def cpu_trust_dir(self) -> Path:
        return self.root / "cpu"


def parse_created(text: object, what: str = "created") -> datetime:
    """An RFC 3339 UTC time with whole seconds (`2026-11-10T00:00:00Z`), the only form a bundle
    holds. Raises TrustBundleError."""
    if not isinstance(text, str) or not _CREATED.fullmatch(text):
        raise TrustBundleError(f"{what} must be an RFC 3339 UTC time like 2026-11-10T00:00:00Z")
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        raise TrustBundleError(f"{what} {text} is not a valid date and time") from None


def format_created(created: datetime) -> str:
    return created.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def manifest_bytes(created: datetime, files: Iterable[ManifestEntry]) -> bytes:
    """The canonical manifest: sorted keys and paths, one trailing newline."""
    document = {
        "format": FORMAT,
        "created": format_created(created),
        "files": [
            {"path": e.path, "sha256": e.sha256, "size": e.size}
            for e in sorted(files, key=lambda e: e.path)
        ],
    }
    text = json.dumps(document, indent=1, sort_keys=True, ensure_ascii=True)
    return (text + "\n").encode("ascii")


def check_layout_path(path: str, what: str) -> str:
    """`path` if the layout names it (relative, `/`-separated, no `.`/`..`), else
    TrustBundleError naming it."""
    if not LAYOUT.fullmatch(path):
        shown = repr(path[:200])
        raise TrustBundleError(
            f"{what}: {shown} is not a file of the trust bundle layout (gpu/rims/, "
            "gpu/revocation/, cpu/snp/, cpu/tdx/: docs/ATTESTATION.md)"
        )
    return path


def bundle_digest(manifest: bytes) -> str:
    return hashlib.sha256(manifest).hexdigest()


def load_release_public_key(path: Path) -> Ed25519PublicKey:
    """The Ed25519 public key (SubjectPublicKeyInfo PEM, `release-key.pub`) at `path`. Raises
    TrustBundleError."""
    data = read_file(
        path, what="release public key", error=TrustBundleError, max_bytes=MAX_PUBLIC_KEY_BYTES
    )
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise TrustBundleError(f"release public key {path} is not a PEM public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise TrustBundleError(f"release public key {path} is not an Ed25519 key")
    return key


def walk_bundle(root: Path) -> dict[str, int]:
    """Step 1: every regular file under `root` (relative path → size), after refusing links,
    special files, directories and names outside the layout, and bundles over the limits.
    Raises TrustBundleError."""
    if root.is_symlink():
        raise TrustBundleError(f"{root} is a symbolic link: name the bundle itself")
    files: dict[str, int] = {}
    total = 0
    pending = [""]
    while pending:
        relative_dir = pending.pop()
        try:
            names = sorted(os.listdir(root / relative_dir))
        except OSError as exc:
            raise TrustBundleError(f"cannot read the trust bundle {root}: {exc}") from exc
        for name in names:
            relative = f"{relative_dir}/{name}" if relative_dir else name
            mode = os.lstat(root / relative).st_mode
            if stat.S_ISLNK(mode):
                raise TrustBundleError(f"{relative} is a symbolic link; a bundle holds none")
            if stat.S_ISDIR(mode):
                if relative not in LAYOUT_DIRECTORIES:
                    raise TrustBundleError(f"{relative}/ is not a directory of the layout")
                pending.append(relative)
                continue
            if not stat.S_ISREG(mode):
                raise TrustBundleError(f"{relative} is not a regular file")
            if relative not in (MANIFEST_NAME, SIGNATURE_NAME):
                check_layout_path(relative, "trust bundle")
            size = os.lstat(root / relative).st_size
            total += size
            if size > MAX_FILE_BYTES or total > MAX_BUNDLE_BYTES or len(files) >= MAX_FILES:
                raise TrustBundleError(
                    f"the trust bundle is over its limits ({MAX_FILES} files, "
                    f"{MAX_FILE_BYTES >> 20} MiB a file, {MAX_BUNDLE_BYTES >> 20} MiB in all)"
                )
            files[relative] = size
    return files


def parse_manifest(raw: bytes) -> tuple[datetime, tuple[ManifestEntry, ...]]:
    """Step 3, on a manifest whose signature verified: its `created` and files."""
    document = parse_json(
        raw, what=MANIFEST_NAME, error=TrustBundleError, max_bytes=MAX_MANIFEST_BYTES
    )
    if not isinstance(document, dict) or set(document) != {"format", "created", "files"}:
        raise TrustBundleError(f"{MANIFEST_NAME} does not have the fields of {FORMAT}")
    if document["format"] != FORMAT:
        raise TrustBundleError(f"{MANIFEST_NAME} is not {FORMAT} (it says {document['format']!r})")
    created = parse_created(document["created"], f"{MANIFEST_NAME} created")
    files = document["files"]
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise TrustBundleError(f"{MANIFEST_NAME}: files is not a list of at most {MAX_FILES}")
    entries: list[ManifestEntry] = []
    for item in files:
        if not isinstance(item, dict) or set(item) != {"path", "sha256", "size"}:
            raise TrustBundleError(f"{MANIFEST_NAME}: a file entry without path, sha256 and size")
        path, digest, size = item["path"], item["sha256"], item["size"]
        if not isinstance(path, str):
            raise TrustBundleError(f"{MANIFEST_NAME}: a path that is not a string")
        check_layout_path(path, MANIFEST_NAME)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise TrustBundleError(f"{MANIFEST_NAME}: {path}: sha256 is not 64 lowercase hex")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES:
            raise TrustBundleError(f"{MANIFEST_NAME}: {path}: size is not 0 to {MAX_FILE_BYTES}")
        entries.append(ManifestEntry(path, digest, size))
    if [e.path for e in entries] != sorted({e.path for e in entries}):
        raise TrustBundleError(f"{MANIFEST_NAME}: the files are not sorted, or one is listed twice")
    return created, tuple(entries)


def verify_trust_bundle(root: Path, public_key: Ed25519PublicKey) -> TrustBundle:
    """Verify the bundle in the directory `root` (the steps of the module docstring) against
    the release key. Raises TrustBundleError naming the first defect."""
    root = Path(root)
    present = walk_bundle(root)  # 1
    for name in (MANIFEST_NAME, SIGNATURE_NAME):
        if name not in present:
            raise TrustBundleError(f"the trust bundle has no {name}")
    raw = read_file(
        root / MANIFEST_NAME, what=MANIFEST_NAME, error=TrustBundleError,
        max_bytes=MAX_MANIFEST_BYTES,
    )  # fmt: skip
    signature = read_file(
        root / SIGNATURE_NAME, what=SIGNATURE_NAME, error=TrustBundleError, max_bytes=64
    )
    try:  # 2
        public_key.verify(signature, raw)
    except InvalidSignature:
        raise TrustBundleError(
            f"{SIGNATURE_NAME} does not verify against the release key (another key signed "
            "the bundle, or its manifest was changed)"
        ) from None
    created, entries = parse_manifest(raw)  # 3
    listed = {entry.path for entry in entries}
    present_files = set(present) - {MANIFEST_NAME, SIGNATURE_NAME}
    if extra := sorted(present_files - listed):  # 4
        raise TrustBundleError(f"{extra[0]} is not in the manifest (a file was added)")
    if missing := sorted(listed - present_files):
        raise TrustBundleError(f"{missing[0]} is in the manifest but missing (a file was removed)")
    for entry in entries:
        if present[entry.path] != entry.size or file_sha256(root / entry.path) != entry.sha256:
            raise TrustBundleError(f"{entry.path} has the wrong SHA-256 (the file was modified)")
    return TrustBundle(root, TrustBundleId(bundle_digest(raw), created), entries)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_trust_bundle_tar(tar_path: Path, dest: Path) -> None:
    """Extract the tar at `tar_path` into the empty directory `dest` after checking every
    member: a regular file or a directory of the layout, under its limits, no links, no device,
    no name twice. Raises TrustBundleError (a truncated tar too); `dest` is then to be removed
    by the caller. The extracted copy is still to be verified (`verify_trust_bundle`)."""
    name = tar_path.name
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            total = 0
            for num_members, member in enumerate(tar, start=1):
                path = member.name.removesuffix("/")
                if num_members > MAX_FILES + len(LAYOUT_DIRECTORIES) + 2:
                    raise TrustBundleError(f"{name} has more members than a bundle may")
                if member.isdir():
                    if path not in LAYOUT_DIRECTORIES:
                        raise TrustBundleError(f"{name}: {path!r} is not a directory of the layout")
                    (dest / path).mkdir(mode=0o700, parents=True, exist_ok=True)
                    continue
                if path not in (MANIFEST_NAME, SIGNATURE_NAME):
                    check_layout_path(path, name)
                if not member.isreg():
                    raise TrustBundleError(
                        f"{name}: {path} is a link or special file; none is allowed"
                    )
                total += member.size
                if member.size > MAX_FILE_BYTES or total > MAX_BUNDLE_BYTES:
                    raise TrustBundleError(f"{name}: {path} is over the bundle's size limits")
                _extract_member(tar, member, dest / path, name)
    except FileExistsError as exc:
        raise TrustBundleError(f"{name} holds a member twice ({Path(exc.filename).name})") from None
    except (tarfile.TarError, EOFError) as exc:
        raise TrustBundleError(f"{name} is truncated or not a tar ({exc})") from exc


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path, name: str) -> None:
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None, "a regular member has a file object"
    with source, open(target, "xb") as out:
        written = 0
        while block := source.read(_CHUNK):
            written += len(block)
            out.write(block)
    if written != member.size:
        raise TrustBundleError(f"{name} is truncated (in member {member.name})")
