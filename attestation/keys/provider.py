"""The key-provider seam and the settings that choose a provider.

Contract of every provider (ARCHITECTURE.md, start-up step 5):
- `release_data_key(key_id, wrapped_key, verdict)` first checks `verdict.trusted` and, if it
  is not, raises KeyReleaseError before it reads a key file, opens an HSM session or sends a
  request: an untrusted platform never causes a key to be touched. Only then does it unwrap
  `wrapped_key` (from the sealed model's signed manifest) with key `key_id` and return the
  32-byte data key, which the caller keeps in memory only.
- `wrap_data_key(key_id, data_key)` is the sealer's side: the wrapped form stored in the
  manifest. It needs no verdict (the plaintext key is already in the sealer's hands).
Errors are KeyReleaseError with a message that never contains key material.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from attestation.errors import KeyReleaseError
from attestation.verdict import Verdict


class KeyProvider(Protocol):
    """Wraps data keys for sealing and releases them against a trusted verdict."""

    def wrap_data_key(self, key_id: str, data_key: bytes) -> bytes: ...

    def release_data_key(self, key_id: str, wrapped_key: bytes, verdict: Verdict) -> bytes: ...


def require_trusted(verdict: Verdict, key_id: str) -> None:
    """Raise KeyReleaseError unless `verdict` is trusted (the first step of every release)."""
    if not isinstance(verdict, Verdict) or not verdict.trusted:
        failed = (
            ", ".join(check.name for check in verdict.failures)
            if isinstance(verdict, Verdict)
            else "no verdict"
        )
        raise KeyReleaseError(
            f"key {key_id!r} is not released: the attestation verdict is not trusted "
            f"(failed: {failed or 'no check ran'})"
        )


@dataclass(frozen=True, slots=True)
class FileKeySettings:
    """`file` provider (development only): key-encryption keys as `<key_dir>/<key_id>.kek`."""

    key_dir: Path


@dataclass(frozen=True, slots=True)
class Pkcs11KeySettings:
    """`pkcs11` provider: the vendor's PKCS#11 module (.so), the token's label, and a file
    holding the user PIN (mode 0600; the PIN never appears in the config itself). The key id
    of a sealed model is the label of its AES key-encryption key on the token."""

    module_path: Path
    token_label: str
    pin_file: Path


KeyProviderSettings = FileKeySettings | Pkcs11KeySettings


def open_key_provider(settings: KeyProviderSettings, *, production: bool) -> KeyProvider:
    """The provider these settings describe. Raises KeyReleaseError for the `file` provider when
    `production` is true, and for an unreadable PIN file. Opens no device and reads no key: that
    happens at the first release, after the verdict."""
    if isinstance(settings, FileKeySettings):
        from attestation.keys.file import FileKeyProvider

        return FileKeyProvider(settings.key_dir, production=production)
    if isinstance(settings, Pkcs11KeySettings):
        from attestation.keys.pkcs11 import Pkcs11KeyProvider

        return Pkcs11KeyProvider.from_settings(settings)
    raise KeyReleaseError(f"unknown key provider settings {type(settings).__name__}")
