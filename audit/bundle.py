"""The export bundle's layout, its manifest, and reading a bundle from a directory or a tar.

    manifest.json           what was exported (not signed: the verifier trusts none of it blindly)
    entries.jsonl           one entry per line: the exact canonical bytes that were hashed
    checkpoints/<size>.txt  every signed checkpoint of a size within the exported range
    VERIFY.md               how to verify the bundle offline

An export may start after the first entry. Its manifest then carries `prefix`, the hashes of the
perfect subtrees of the entries before it (RFC 9162's compact range of [0, first_index)); with
them the verifier recomputes the root at every checkpoint from the exported entries alone. The
prefix is authenticated by the same signed roots: a forged prefix cannot reproduce them.

Standard library only: the offline verifier reads bundles through this module.
"""

from __future__ import annotations

import itertools
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, TypeVar

from audit.bundle_json import MAX_ENTRY_BYTES, MAX_MANIFEST_BYTES, parse_json
from audit.encoding import decode_base64, encode_base64
from audit.errors import AuditError, BundleFormatError
from audit.merkle import HASH_SIZE

T = TypeVar("T")

FORMAT = "inferno-audit-bundle/1"
MANIFEST = "manifest.json"
ENTRIES = "entries.jsonl"
CHECKPOINTS = "checkpoints"
VERIFY_DOC = "VERIFY.md"


def checkpoint_name(size: int) -> str:
    return f"{CHECKPOINTS}/{size}.txt"


@dataclass(frozen=True)
class Manifest:
    origin: str
    first_index: int
    num_entries: int
    prefix: list[bytes]
    checkpoint_sizes: list[int]
    exported_at: str
    export_entry: int

    def to_json(self) -> bytes:
        return (
            json.dumps(
                {
                    "format": FORMAT,
                    "origin": self.origin,
                    "first_index": self.first_index,
                    "num_entries": self.num_entries,
                    "prefix": [encode_base64(h) for h in self.prefix],
                    "checkpoint_sizes": self.checkpoint_sizes,
                    "exported_at": self.exported_at,
                    "export_entry": self.export_entry,
                },
                indent=2,
            ).encode()
            + b"\n"
        )

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        """Parse a manifest within the limits of audit.bundle_json. Raises BundleFormatError."""
        raw = parse_json(data, what=MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise BundleFormatError(f"{MANIFEST} is not an {FORMAT} manifest")
        prefix = []
        for value in _member(raw, "prefix", list):
            if not isinstance(value, str):
                raise BundleFormatError(f"{MANIFEST}: 'prefix' must hold base64 strings")
            try:
                prefix.append(decode_base64(value, "prefix hash"))
            except AuditError as exc:
                raise BundleFormatError(f"{MANIFEST}: {exc}") from exc
        if any(len(h) != HASH_SIZE for h in prefix):
            raise BundleFormatError(f"{MANIFEST}: 'prefix' hashes must be {HASH_SIZE} bytes")
        sizes = _member(raw, "checkpoint_sizes", list)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise BundleFormatError(f"{MANIFEST}: 'checkpoint_sizes' must be integers")
        manifest = cls(
            origin=_member(raw, "origin", str),
            first_index=_member(raw, "first_index", int),
            num_entries=_member(raw, "num_entries", int),
            prefix=prefix,
            checkpoint_sizes=sizes,
            exported_at=_member(raw, "exported_at", str),
            export_entry=_member(raw, "export_entry", int),
        )
        if manifest.first_index < 0 or manifest.num_entries < 0:
            raise BundleFormatError(f"{MANIFEST}: negative first_index or num_entries")
        if len(prefix) != manifest.first_index.bit_count():
            raise BundleFormatError(
                f"{MANIFEST}: 'prefix' must hold {manifest.first_index.bit_count()} hashes for "
                f"first_index {manifest.first_index}, not {len(prefix)}"
            )
        return manifest


def _member(raw: dict[str, object], name: str, kind: type[T]) -> T:
    value = raw.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BundleFormatError(f"{MANIFEST}: {name!r} is missing or not a {kind.__name__}")
    return value


class BundleReader:
    """Read access to a bundle, whether a directory or a tar of one (members at its root)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            if not (path / MANIFEST).is_file():
                raise BundleFormatError(f"{path} is not an audit bundle: it has no {MANIFEST}")
        elif path.is_file():
            try:
                self._tar = tarfile.open(path)  # noqa: SIM115 (closed by close())
            except (tarfile.TarError, OSError) as exc:
                raise BundleFormatError(f"{path} is neither a bundle directory nor a tar") from exc
            for member in self._tar.getmembers():
                name = str(PurePosixPath(member.name))
                if member.isdir():
                    continue
                if not member.isfile() or name.startswith("/") or ".." in name.split("/"):
                    raise BundleFormatError(f"{path}: tar member {member.name!r} is not allowed")
                if name in self._members:
                    raise BundleFormatError(f"{path}: tar holds {name} twice")
                self._members[name] = member
            if MANIFEST not in self._members:
                raise BundleFormatError(f"{path} is not an audit bundle: it has no {MANIFEST}")
        else:
            raise BundleFormatError(f"{path} does not exist")

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def open(self, name: str) -> IO[bytes]:
        if self._tar is None:
            try:
                return (self.path / name).open("rb")
            except OSError as exc:
                raise BundleFormatError(f"bundle has no readable {name}") from exc
        member = self._members.get(name)
        extracted = None if member is None else self._tar.extractfile(member)
        if extracted is None:
            raise BundleFormatError(f"bundle has no {name}")
        return extracted

    def read(self, name: str, *, max_bytes: int) -> bytes:
        """The bytes of `name`, reading no more than `max_bytes` + 1 of them. Raises
        BundleFormatError for a larger file."""
        with self.open(name) as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise BundleFormatError(f"{name} is over the limit of {max_bytes} bytes")
        return data

    def entry_lines(self) -> Iterator[bytes]:
        """Each line of entries.jsonl with its newline (the last may lack one), reading no more
        than one entry's limit (audit.bundle_json.MAX_ENTRY_BYTES) and its newline at a time.
        Raises BundleFormatError for a longer line, naming it."""
        with self.open(ENTRIES) as file:
            for line_number in itertools.count(1):
                line = file.readline(MAX_ENTRY_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_ENTRY_BYTES and not line.endswith(b"\n"):
                    raise BundleFormatError(
                        f"{ENTRIES} line {line_number} is over the limit of {MAX_ENTRY_BYTES} "
                        "bytes for one entry"
                    )
                yield line

    def checkpoint_files(self) -> Iterator[str]:
        """The names of all files under checkpoints/, sorted."""
        if self._tar is None:
            folder = self.path / CHECKPOINTS
            if not folder.is_dir():
                raise BundleFormatError(f"bundle has no {CHECKPOINTS}/ folder")
            yield from sorted(f"{CHECKPOINTS}/{p.name}" for p in folder.iterdir())
        else:
            yield from sorted(n for n in self._members if n.startswith(f"{CHECKPOINTS}/"))
