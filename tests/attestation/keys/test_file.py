"""The `file` provider (development only): round trip, refusal without a trusted verdict before
the key file is read, production refusal, and the key file's hygiene."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attestation.errors import KeyReleaseError
from attestation.keys import FileKeySettings, open_key_provider
from attestation.keys.file import FileKeyProvider
from attestation.verdict import Verdict
from tests.attestation.keys.conftest import TRUSTED, UNTRUSTED


@pytest.fixture
def provider(tmp_path: Path) -> FileKeyProvider:
    provider = FileKeyProvider(tmp_path / "keys", production=False)
    provider.create_key("kek-1")
    return provider


def test_a_wrapped_key_is_released_against_a_trusted_verdict(provider: FileKeyProvider) -> None:
    data_key = os.urandom(32)
    wrapped = provider.wrap_data_key("kek-1", data_key)
    assert data_key not in wrapped
    assert provider.release_data_key("kek-1", wrapped, TRUSTED) == data_key


@pytest.mark.parametrize("case", sorted(UNTRUSTED))
def test_an_untrusted_verdict_is_refused_before_the_key_file_is_read(
    provider: FileKeyProvider, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    wrapped = provider.wrap_data_key("kek-1", os.urandom(32))
    reads: list[Path] = []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or "")
    with pytest.raises(KeyReleaseError, match="verdict is not trusted"):
        provider.release_data_key("kek-1", wrapped, UNTRUSTED[case])
    assert reads == []


def test_the_refusal_names_the_failed_checks(provider: FileKeyProvider) -> None:
    with pytest.raises(KeyReleaseError, match=r"failed: snp\.policy\.debug"):
        provider.release_data_key("kek-1", b"", UNTRUSTED["a failed check"])


def test_something_that_is_not_a_verdict_is_refused(provider: FileKeyProvider) -> None:
    with pytest.raises(KeyReleaseError, match="no verdict"):
        provider.release_data_key("kek-1", b"", True)  # type: ignore[arg-type]


def test_production_refuses_the_file_provider(tmp_path: Path) -> None:
    with pytest.raises(KeyReleaseError, match="development only"):
        FileKeyProvider(tmp_path, production=True)
    with pytest.raises(KeyReleaseError, match="development only"):
        open_key_provider(FileKeySettings(key_dir=tmp_path), production=True)


def test_a_key_wrapped_for_one_key_id_does_not_unwrap_under_another(
    provider: FileKeyProvider,
) -> None:
    provider.create_key("kek-2")
    wrapped = provider.wrap_data_key("kek-1", os.urandom(32))
    with pytest.raises(KeyReleaseError, match="does not unwrap under key 'kek-2'"):
        provider.release_data_key("kek-2", wrapped, TRUSTED)


def test_an_altered_wrapped_key_is_refused(provider: FileKeyProvider) -> None:
    wrapped = bytearray(provider.wrap_data_key("kek-1", os.urandom(32)))
    wrapped[20] ^= 1
    with pytest.raises(KeyReleaseError, match="altered"):
        provider.release_data_key("kek-1", bytes(wrapped), TRUSTED)


def test_a_key_file_readable_by_others_is_refused(provider: FileKeyProvider) -> None:
    (provider.key_dir / "kek-1.kek").chmod(0o644)
    with pytest.raises(KeyReleaseError, match="chmod 600"):
        provider.wrap_data_key("kek-1", os.urandom(32))


def test_a_missing_key_file_is_named(provider: FileKeyProvider) -> None:
    with pytest.raises(KeyReleaseError, match="no key file"):
        provider.release_data_key("kek-9", b"x" * 60, TRUSTED)


def test_a_key_id_that_is_a_path_is_refused(provider: FileKeyProvider) -> None:
    with pytest.raises(KeyReleaseError, match="not a plain name"):
        provider.wrap_data_key("../kek-1", os.urandom(32))


def test_create_key_never_overwrites(provider: FileKeyProvider) -> None:
    with pytest.raises(KeyReleaseError, match="already exists"):
        provider.create_key("kek-1")


def test_open_key_provider_builds_the_file_provider_in_development(tmp_path: Path) -> None:
    provider = open_key_provider(FileKeySettings(key_dir=tmp_path), production=False)
    assert isinstance(provider, FileKeyProvider)


def test_verdict_type_is_the_shared_one() -> None:
    assert isinstance(TRUSTED, Verdict) and TRUSTED.trusted
