"""The `broker` seam: an on-premises key broker that checks the evidence itself.

With an HSM (pkcs11) the appliance's own verdict is what stands between the platform and the
key. A key broker adds a second, independent judge: the appliance sends it the wrapped data key
and its evidence (the CPU report whose report_data binds the appliance's key-release public key,
attestation.binding, and the GPU evidence), the broker verifies them against its own policy and,
only if it is satisfied, returns the data key encrypted to that key-release public key. A host
that did not attest never holds the private key the answer is encrypted to.

How a deployment plugs a broker in: implement `KeyBroker.release` over its transport (HTTPS to
the broker, a vendor SDK, a local socket), then construct

    BrokerKeyProvider(broker, recipient=<the per-boot X25519 key whose public key is bound in
                      report_data>, evidence=<callable returning that evidence document>)

and hand it to the boot gate like any other KeyProvider. No transport ships here: there is no
standard key-broker protocol to implement yet, and a fake one would only hide that.

Answer format (`seal_to_recipient` makes one, for broker implementers and tests):
    ephemeral X25519 public key (32) ‖ AES-256-GCM(k, data key, aad = key_id), nonce = 12 zero
    bytes, where k = HKDF-SHA256(X25519(ephemeral, recipient), salt = ephemeral ‖ recipient,
    info = b"inferno-key-release/1") (a fresh ephemeral key per answer, so k is never reused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from attestation.errors import KeyReleaseError
from attestation.keys.provider import require_trusted
from attestation.verdict import Verdict

_INFO = b"inferno-key-release/1"
_NONCE = bytes(12)


@dataclass(frozen=True, slots=True)
class BrokerRequest:
    """What the appliance sends: the model's key id and wrapped key (from the signed manifest),
    its evidence document, and the raw X25519 public key the answer must be encrypted to (the
    one bound in the evidence's report_data)."""

    key_id: str
    wrapped_key: bytes
    evidence: bytes
    recipient_public_key: bytes


class KeyBroker(Protocol):
    """The transport to a key broker: returns the answer (format in the module docstring), or
    raises KeyReleaseError when the broker refuses or cannot be reached."""

    def release(self, request: BrokerRequest) -> bytes: ...


class BrokerKeyProvider:
    """A KeyProvider that asks a key broker (see the module docstring)."""

    def __init__(
        self, broker: KeyBroker, *, recipient: X25519PrivateKey, evidence: Callable[[], bytes]
    ) -> None:
        self.broker = broker
        self._recipient = recipient
        self._evidence = evidence

    def wrap_data_key(self, key_id: str, data_key: bytes) -> bytes:
        raise KeyReleaseError(
            "a key broker wraps data keys with its own tools; seal the model with the wrapped "
            "key the broker gives you"
        )

    def release_data_key(self, key_id: str, wrapped_key: bytes, verdict: Verdict) -> bytes:
        # The broker judges the evidence itself, but an appliance that does not trust its own
        # platform does not even ask.
        require_trusted(verdict, key_id)
        recipient = _raw(self._recipient.public_key())
        answer = self.broker.release(
            BrokerRequest(key_id, wrapped_key, self._evidence(), recipient)
        )
        return open_released_key(self._recipient, key_id, answer)


def seal_to_recipient(recipient_public_key: bytes, key_id: str, data_key: bytes) -> bytes:
    """The broker's answer: `data_key` encrypted to the appliance's key-release public key."""
    ephemeral = X25519PrivateKey.generate()
    recipient = X25519PublicKey.from_public_bytes(recipient_public_key)
    ephemeral_public = _raw(ephemeral.public_key())
    key = _derive(ephemeral.exchange(recipient), ephemeral_public, recipient_public_key)
    return ephemeral_public + AESGCM(key).encrypt(_NONCE, data_key, key_id.encode())


def open_released_key(recipient: X25519PrivateKey, key_id: str, answer: bytes) -> bytes:
    """The data key inside a broker's answer. Raises KeyReleaseError if it is not for this
    recipient and key id, or was altered."""
    if len(answer) < 32 + 16:
        raise KeyReleaseError("the key broker's answer is too short to hold a key")
    ephemeral_public = answer[:32]
    try:
        shared = recipient.exchange(X25519PublicKey.from_public_bytes(ephemeral_public))
        key = _derive(shared, ephemeral_public, _raw(recipient.public_key()))
        return AESGCM(key).decrypt(_NONCE, answer[32:], key_id.encode())
    except (InvalidTag, ValueError):
        raise KeyReleaseError(
            f"the key broker's answer for {key_id!r} does not open under this appliance's "
            "key-release key (altered, or meant for another appliance or key)"
        ) from None


def _derive(shared: bytes, ephemeral_public: bytes, recipient_public: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=ephemeral_public + recipient_public, info=_INFO
    ).derive(shared)


def _raw(public_key: X25519PublicKey) -> bytes:
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
