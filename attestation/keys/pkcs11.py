"""The `pkcs11` key provider: the data key is wrapped by an AES-256 key-encryption key (KEK) that
never leaves the HSM.

Wrapping is PKCS#11's own key wrap, CKM_AES_KEY_WRAP_PAD (RFC 5649): the data key is imported as
a short-lived session object and wrapped by the KEK on the token; release unwraps it into a
session object that is extractable (the host must decrypt the weights with it), reads its value
and destroys the object at once. The KEK is found by its label, which is the sealed model's
`key_id`, and is created non-extractable and sensitive (`create_key`).

Tested against SoftHSM2 (Debian's `softhsm2`); any PKCS#11 v2.20+ module with RFC 5649 key wrap
works the same way. The user PIN is read from a file at each use, after the verdict check.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11 import exceptions as p11

from attestation.errors import KeyReleaseError
from attestation.keys.provider import Pkcs11KeySettings, require_trusted
from attestation.verdict import Verdict

_WRAP = Mechanism.AES_KEY_WRAP_PAD
# A PKCS#11 module is initialised once per process; python-pkcs11 refuses a second load.
_LIBRARIES: dict[str, pkcs11.lib] = {}
_LIBRARIES_LOCK = threading.Lock()


class Pkcs11KeyProvider:
    """Data keys wrapped by KEKs on the PKCS#11 token `token_label` of `module_path`."""

    def __init__(self, module_path: Path, token_label: str, pin_file: Path) -> None:
        self.module_path = Path(module_path)
        self.token_label = token_label
        self.pin_file = Path(pin_file)

    @classmethod
    def from_settings(cls, settings: Pkcs11KeySettings) -> Pkcs11KeyProvider:
        return cls(settings.module_path, settings.token_label, settings.pin_file)

    def create_key(self, key_id: str) -> None:
        """Generate a new AES-256 KEK labelled `key_id` on the token (setup, not boot). Refuses
        if one with that label exists."""
        with self._session(rw=True) as session:
            if list(session.get_objects({Attribute.LABEL: key_id})):
                raise KeyReleaseError(f"the token already holds a key labelled {key_id!r}")
            session.generate_key(
                KeyType.AES,
                256,
                label=key_id,
                store=True,
                template={
                    Attribute.WRAP: True,
                    Attribute.UNWRAP: True,
                    Attribute.ENCRYPT: False,
                    Attribute.DECRYPT: False,
                    Attribute.EXTRACTABLE: False,
                    Attribute.SENSITIVE: True,
                },
            )

    def wrap_data_key(self, key_id: str, data_key: bytes) -> bytes:
        with self._session() as session:
            kek = self._kek(session, key_id)
            data = session.create_object(
                {
                    Attribute.CLASS: ObjectClass.SECRET_KEY,
                    Attribute.KEY_TYPE: KeyType.AES,
                    Attribute.VALUE: data_key,
                    Attribute.TOKEN: False,
                    Attribute.EXTRACTABLE: True,
                    Attribute.SENSITIVE: False,
                }
            )
            try:
                return bytes(kek.wrap_key(data, mechanism=_WRAP))
            except p11.PKCS11Error as exc:
                raise KeyReleaseError(f"the token cannot wrap under {key_id!r}: {exc!r}") from exc
            finally:
                data.destroy()

    def release_data_key(self, key_id: str, wrapped_key: bytes, verdict: Verdict) -> bytes:
        require_trusted(verdict, key_id)
        with self._session() as session:
            kek = self._kek(session, key_id)
            try:
                data = kek.unwrap_key(
                    ObjectClass.SECRET_KEY,
                    KeyType.AES,
                    wrapped_key,
                    mechanism=_WRAP,
                    store=False,
                    template={Attribute.EXTRACTABLE: True, Attribute.SENSITIVE: False},
                )
            except p11.PKCS11Error:
                raise KeyReleaseError(
                    f"the wrapped data key does not unwrap under {key_id!r} on token "
                    f"{self.token_label!r}: it was wrapped under another key, or altered"
                ) from None
            try:
                return bytes(data[Attribute.VALUE])
            finally:
                data.destroy()

    @contextmanager
    def _session(self, *, rw: bool = False) -> Iterator[pkcs11.Session]:
        try:
            token = _library(self.module_path).get_token(token_label=self.token_label)
            with token.open(user_pin=self._pin(), rw=rw) as session:
                yield session
        except p11.NoSuchToken:
            raise KeyReleaseError(
                f"no PKCS#11 token labelled {self.token_label!r} in {self.module_path}"
            ) from None
        except (p11.PinIncorrect, p11.PinInvalid, p11.PinLocked, p11.PinExpired) as exc:
            raise KeyReleaseError(
                f"the token {self.token_label!r} refused the PIN in {self.pin_file} "
                f"({type(exc).__name__})"
            ) from None
        except p11.PKCS11Error as exc:
            raise KeyReleaseError(
                f"PKCS#11 module {self.module_path}, token {self.token_label!r}: {exc!r}"
            ) from exc

    def _kek(self, session: pkcs11.Session, key_id: str) -> pkcs11.SecretKey:
        try:
            return session.get_key(
                object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label=key_id
            )
        except p11.NoSuchKey:
            raise KeyReleaseError(
                f"the token {self.token_label!r} holds no AES key labelled {key_id!r}"
            ) from None
        except p11.MultipleObjectsReturned:
            raise KeyReleaseError(
                f"the token {self.token_label!r} holds several keys labelled {key_id!r}"
            ) from None

    def _pin(self) -> str:
        try:
            mode = os.stat(self.pin_file).st_mode
            pin = self.pin_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyReleaseError(f"cannot read the PIN file {self.pin_file}: {exc}") from exc
        if stat.S_IMODE(mode) & 0o077:
            raise KeyReleaseError(f"the PIN file {self.pin_file} is readable by others; chmod 600")
        if not pin:
            raise KeyReleaseError(f"the PIN file {self.pin_file} is empty")
        return pin


def _library(module_path: Path) -> pkcs11.lib:
    with _LIBRARIES_LOCK:
        key = str(module_path)
        if key not in _LIBRARIES:
            _LIBRARIES[key] = pkcs11.lib(key)
        return _LIBRARIES[key]
