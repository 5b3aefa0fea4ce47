"""The `pkcs11` provider on a real SoftHSM2 token: RFC 5649 key wrap under a KEK that never
leaves the token, refusal without a trusted verdict before any session opens, and the token's
own refusals (wrong PIN, missing key, altered wrapped key) as KeyReleaseError."""

from __future__ import annotations

import os
from pathlib import Path

import pkcs11
import pytest
from pkcs11 import Attribute, KeyType, ObjectClass

from attestation.errors import KeyReleaseError
from attestation.keys import Pkcs11KeySettings, open_key_provider
from attestation.keys.pkcs11 import Pkcs11KeyProvider
from tests.attestation.keys.conftest import TRUSTED, UNTRUSTED
from tests.attestation.keys.softhsm import USER_PIN


@pytest.fixture
def provider(softhsm: Pkcs11KeySettings) -> Pkcs11KeyProvider:
    return Pkcs11KeyProvider.from_settings(softhsm)


def _new_kek(provider: Pkcs11KeyProvider) -> str:
    label = "kek-" + os.urandom(6).hex()
    provider.create_key(label)
    return label


def test_a_data_key_round_trips_through_the_token(provider: Pkcs11KeyProvider) -> None:
    label = _new_kek(provider)
    data_key = os.urandom(32)
    wrapped = provider.wrap_data_key(label, data_key)
    assert len(wrapped) == 40 and data_key not in wrapped  # RFC 5649: 32 bytes + 8
    assert provider.release_data_key(label, wrapped, TRUSTED) == data_key


def test_open_key_provider_builds_the_pkcs11_provider_even_in_production(
    softhsm: Pkcs11KeySettings,
) -> None:
    provider = open_key_provider(softhsm, production=True)
    assert isinstance(provider, Pkcs11KeyProvider)


@pytest.mark.parametrize("case", sorted(UNTRUSTED))
def test_an_untrusted_verdict_is_refused_before_any_session_opens(
    provider: Pkcs11KeyProvider, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    label = _new_kek(provider)
    wrapped = provider.wrap_data_key(label, os.urandom(32))
    opened: list[bool] = []
    monkeypatch.setattr(Pkcs11KeyProvider, "_session", lambda self, **k: opened.append(True))
    with pytest.raises(KeyReleaseError, match="verdict is not trusted"):
        provider.release_data_key(label, wrapped, UNTRUSTED[case])
    assert opened == []


def test_the_kek_cannot_be_read_off_the_token(
    provider: Pkcs11KeyProvider, softhsm: Pkcs11KeySettings
) -> None:
    label = _new_kek(provider)
    token = pkcs11.lib(str(softhsm.module_path)).get_token(token_label=softhsm.token_label)
    with token.open(user_pin=USER_PIN) as session:
        kek = session.get_key(
            object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label=label
        )
        assert kek[Attribute.EXTRACTABLE] is False and kek[Attribute.SENSITIVE] is True
        with pytest.raises(pkcs11.PKCS11Error):
            kek[Attribute.VALUE]


def test_no_data_key_object_stays_on_the_token(
    provider: Pkcs11KeyProvider, softhsm: Pkcs11KeySettings
) -> None:
    label = _new_kek(provider)
    provider.release_data_key(label, provider.wrap_data_key(label, os.urandom(32)), TRUSTED)
    token = pkcs11.lib(str(softhsm.module_path)).get_token(token_label=softhsm.token_label)
    with token.open(user_pin=USER_PIN) as session:
        labels = {obj[Attribute.LABEL] for obj in session.get_objects({})}
    assert all(name.startswith("kek-") for name in labels)


def test_an_altered_wrapped_key_is_refused(provider: Pkcs11KeyProvider) -> None:
    label = _new_kek(provider)
    wrapped = bytearray(provider.wrap_data_key(label, os.urandom(32)))
    wrapped[5] ^= 0x10
    with pytest.raises(KeyReleaseError, match="wrapped under another key, or altered"):
        provider.release_data_key(label, bytes(wrapped), TRUSTED)


def test_a_key_wrapped_under_another_kek_is_refused(provider: Pkcs11KeyProvider) -> None:
    first, second = _new_kek(provider), _new_kek(provider)
    wrapped = provider.wrap_data_key(first, os.urandom(32))
    with pytest.raises(KeyReleaseError, match="does not unwrap"):
        provider.release_data_key(second, wrapped, TRUSTED)


def test_a_missing_kek_is_named(provider: Pkcs11KeyProvider) -> None:
    with pytest.raises(KeyReleaseError, match="holds no AES key labelled 'absent'"):
        provider.release_data_key("absent", b"\0" * 40, TRUSTED)


def test_a_wrong_pin_is_refused(softhsm: Pkcs11KeySettings, tmp_path: Path) -> None:
    pin = tmp_path / "pin"
    pin.write_text("000000")
    pin.chmod(0o600)
    provider = Pkcs11KeyProvider(softhsm.module_path, softhsm.token_label, pin)
    with pytest.raises(KeyReleaseError, match="refused the PIN"):
        provider.wrap_data_key("kek-any", os.urandom(32))


def test_a_pin_file_readable_by_others_is_refused(
    softhsm: Pkcs11KeySettings, tmp_path: Path
) -> None:
    pin = tmp_path / "pin"
    pin.write_text(USER_PIN)
    pin.chmod(0o644)
    provider = Pkcs11KeyProvider(softhsm.module_path, softhsm.token_label, pin)
    with pytest.raises(KeyReleaseError, match="readable by others"):
        provider.wrap_data_key("kek-any", os.urandom(32))


def test_an_unknown_token_is_named(softhsm: Pkcs11KeySettings) -> None:
    provider = Pkcs11KeyProvider(softhsm.module_path, "no-such-token", softhsm.pin_file)
    with pytest.raises(KeyReleaseError, match="no PKCS#11 token labelled 'no-such-token'"):
        provider.wrap_data_key("kek-any", os.urandom(32))


def test_create_key_refuses_a_label_in_use(provider: Pkcs11KeyProvider) -> None:
    label = _new_kek(provider)
    with pytest.raises(KeyReleaseError, match="already holds"):
        provider.create_key(label)
