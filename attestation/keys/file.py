"""The `file` key provider: development and tests only.

Each key-encryption key (KEK) is 32 random bytes, hex, in `<key_dir>/<key_id>.kek`, readable by
its owner only (like an SSH key: a group- or world-readable KEK file is refused). A data key is
wrapped as nonce (12) ‖ AES-256-GCM(KEK, data key, aad = b"inferno-data-key/1" ‖ key_id) (48),
so a wrapped key only unwraps under the key id it was wrapped for.

Whoever can read the KEK file can unseal the model without any attestation, which is why
production refuses this provider (`production=True`).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from attestation.errors import KeyReleaseError
from attestation.keys.provider import require_trusted
from attestation.verdict import Verdict

_KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_AAD = b"inferno-data-key/1"


class FileKeyProvider:
    """KEKs in files under `key_dir` (see the module docstring)."""

    def __init__(self, key_dir: Path, *, production: bool) -> None:
        if production:
            raise KeyReleaseError(
                "the file key provider is for development only: a production appliance needs "
                "an HSM (pkcs11) or a key broker"
            )
        self.key_dir = Path(key_dir)

    def create_key(self, key_id: str) -> Path:
        """Write a new random KEK for `key_id` (mode 0600) and return its path. Refuses to
        overwrite an existing one: models sealed under it would become unreadable."""
        path = self._path(key_id)
        self.key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyReleaseError(f"{path} already exists; choose another key id") from None
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        return path

    def wrap_data_key(self, key_id: str, data_key: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + AESGCM(self._kek(key_id)).encrypt(nonce, data_key, _AAD + key_id.encode())

    def release_data_key(self, key_id: str, wrapped_key: bytes, verdict: Verdict) -> bytes:
        require_trusted(verdict, key_id)
        kek = self._kek(key_id)
        try:
            return AESGCM(kek).decrypt(wrapped_key[:12], wrapped_key[12:], _AAD + key_id.encode())
        except (InvalidTag, ValueError):
            raise KeyReleaseError(
                f"the wrapped data key does not unwrap under key {key_id!r}: it was wrapped "
                "under another key, or altered"
            ) from None

    def _path(self, key_id: str) -> Path:
        if not _KEY_ID.match(key_id):
            raise KeyReleaseError(f"key id {key_id!r} is not a plain name (letters, digits, . _ -)")
        return self.key_dir / f"{key_id}.kek"

    def _kek(self, key_id: str) -> bytes:
        path = self._path(key_id)
        try:
            mode = path.stat().st_mode
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            raise KeyReleaseError(f"no key file {path} for key id {key_id!r}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyReleaseError(f"cannot read key file {path}: {exc}") from exc
        if stat.S_IMODE(mode) & 0o077:
            raise KeyReleaseError(
                f"key file {path} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
            )
        try:
            kek = bytes.fromhex(text)
        except ValueError:
            kek = b""
        if len(kek) != 32:
            raise KeyReleaseError(f"key file {path} does not hold 64 hex digits (a 256-bit key)")
        return kek
