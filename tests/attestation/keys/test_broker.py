"""The broker seam: a fake in-process broker stands in for a real one, judging the evidence it
is sent and answering with the data key encrypted to the appliance's key-release key."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from attestation.errors import KeyReleaseError
from attestation.keys.broker import (
    BrokerKeyProvider,
    BrokerRequest,
    open_released_key,
    seal_to_recipient,
)
from tests.attestation.keys.conftest import TRUSTED, UNTRUSTED

DATA_KEY = os.urandom(32)


class FakeBroker:
    """Releases DATA_KEY for evidence it accepts (here: the bytes b"good evidence")."""

    def __init__(self) -> None:
        self.requests: list[BrokerRequest] = []

    def release(self, request: BrokerRequest) -> bytes:
        self.requests.append(request)
        if request.evidence != b"good evidence":
            raise KeyReleaseError("the broker rejected the evidence")
        return seal_to_recipient(request.recipient_public_key, request.key_id, DATA_KEY)


def _provider(broker: FakeBroker, evidence: bytes = b"good evidence") -> BrokerKeyProvider:
    return BrokerKeyProvider(
        broker, recipient=X25519PrivateKey.generate(), evidence=lambda: evidence
    )


def test_the_broker_releases_the_key_to_the_attested_recipient() -> None:
    broker = FakeBroker()
    provider = _provider(broker)
    assert provider.release_data_key("kek-1", b"wrapped", TRUSTED) == DATA_KEY
    (request,) = broker.requests
    assert (request.key_id, request.wrapped_key) == ("kek-1", b"wrapped")
    assert len(request.recipient_public_key) == 32


@pytest.mark.parametrize("case", sorted(UNTRUSTED))
def test_an_untrusted_verdict_never_reaches_the_broker(case: str) -> None:
    broker = FakeBroker()
    with pytest.raises(KeyReleaseError, match="verdict is not trusted"):
        _provider(broker).release_data_key("kek-1", b"wrapped", UNTRUSTED[case])
    assert broker.requests == []


def test_the_brokers_refusal_is_a_key_release_error() -> None:
    with pytest.raises(KeyReleaseError, match="rejected the evidence"):
        _provider(FakeBroker(), b"bad evidence").release_data_key("kek-1", b"w", TRUSTED)


def test_an_answer_for_another_appliance_does_not_open() -> None:
    other = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    answer = seal_to_recipient(other, "kek-1", DATA_KEY)
    with pytest.raises(KeyReleaseError, match="does not open under this appliance"):
        open_released_key(X25519PrivateKey.generate(), "kek-1", answer)


def test_an_answer_for_another_key_id_or_altered_does_not_open() -> None:
    recipient = X25519PrivateKey.generate()
    public = recipient.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    answer = seal_to_recipient(public, "kek-1", DATA_KEY)
    assert open_released_key(recipient, "kek-1", answer) == DATA_KEY
    with pytest.raises(KeyReleaseError):
        open_released_key(recipient, "kek-2", answer)
    with pytest.raises(KeyReleaseError):
        open_released_key(recipient, "kek-1", answer[:-1] + bytes([answer[-1] ^ 1]))
    with pytest.raises(KeyReleaseError, match="too short"):
        open_released_key(recipient, "kek-1", answer[:40])


def test_a_broker_provider_does_not_wrap_keys() -> None:
    with pytest.raises(KeyReleaseError, match="broker wraps data keys with its own tools"):
        _provider(FakeBroker()).wrap_data_key("kek-1", DATA_KEY)
