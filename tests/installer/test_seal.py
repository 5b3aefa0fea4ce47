"""`python -m installer seal-keys` and `seal`, end to end: the sealed directory opens under the
public key it printed, and the released key decrypts weights identical to the source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

from attestation.keys import Pkcs11KeySettings
from attestation.keys.file import FileKeyProvider
from attestation.keys.pkcs11 import Pkcs11KeyProvider
from attestation.sealed import SealedModel, load_manifest_public_key
from installer.__main__ import main
from tests.attestation.keys.conftest import TRUSTED
from tests.attestation.keys.softhsm import softhsm_module, softhsm_token
from tests.attestation.sealed.conftest import write_model


@pytest.fixture
def softhsm() -> Pkcs11KeySettings:
    if softhsm_module() is None:
        pytest.skip("SoftHSM2 is not installed (./bootstrap test installs Debian's softhsm2)")
    return softhsm_token()


def _assert_unseals_to_source(
    sealed_dir: Path, source: Path, keys: Path, provider: FileKeyProvider | Pkcs11KeyProvider
) -> None:
    model = SealedModel.open(
        sealed_dir, manifest_key=load_manifest_public_key(keys / "manifest.pub")
    )
    manifest = model.manifest
    data_key = provider.release_data_key(manifest.key_id, manifest.wrapped_key, TRUSTED)
    weights = model.decrypt_all(data_key, workers=2)
    for name, plaintext in weights.items():
        original = load_file(source / name)
        unsealed = load(bytes(plaintext))
        assert all(torch.equal(original[k], unsealed[k]) for k in original)


def test_seal_keys_then_seal_with_the_file_provider(tmp_path: Path) -> None:
    source = write_model(tmp_path / "src")
    keys = tmp_path / "keys"
    assert main(["seal-keys", str(keys), "--key-id", "dev-kek"]) == 0
    assert (keys / "manifest-signing.pem").stat().st_mode & 0o777 == 0o600
    assert (keys / "dev-kek.kek").exists()
    args = ["seal", str(source), str(tmp_path / "sealed"), "--model-id", "acme/test",
            "--key-id", "dev-kek", "--signing-key", str(keys / "manifest-signing.pem"),
            "--key-dir", str(keys), "--chunk-mib", "1", "--workers", "2"]  # fmt: skip
    assert main(args) == 0
    provider = FileKeyProvider(keys, production=False)
    _assert_unseals_to_source(tmp_path / "sealed", source, keys, provider)


def test_seal_with_the_pkcs11_provider(tmp_path: Path, softhsm: Pkcs11KeySettings) -> None:
    source = write_model(tmp_path / "src")
    keys = tmp_path / "keys"
    label = "installer-" + os.urandom(4).hex()
    hsm = ["--key-provider", "pkcs11", "--pkcs11-module", str(softhsm.module_path),
           "--pkcs11-token", softhsm.token_label,
           "--pkcs11-pin-file", str(softhsm.pin_file)]  # fmt: skip
    assert main(["seal-keys", str(keys), "--key-id", label, *hsm]) == 0
    assert not (keys / f"{label}.kek").exists()  # the KEK lives on the token only
    args = ["seal", str(source), str(tmp_path / "sealed"), "--model-id", "acme/test",
            "--key-id", label, "--signing-key", str(keys / "manifest-signing.pem"),
            *hsm]  # fmt: skip
    assert main(args) == 0
    _assert_unseals_to_source(
        tmp_path / "sealed", source, keys, Pkcs11KeyProvider.from_settings(softhsm)
    )


def test_seal_reports_an_unknown_key_and_writes_no_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_model(tmp_path / "src")
    keys = tmp_path / "keys"
    assert main(["seal-keys", str(keys), "--key-id", "dev-kek"]) == 0
    args = ["seal", str(source), str(tmp_path / "sealed"), "--model-id", "m", "--key-id",
            "other-kek", "--signing-key", str(keys / "manifest-signing.pem"), "--key-dir",
            str(keys)]  # fmt: skip
    assert main(args) == 1
    assert "no key file" in capsys.readouterr().err
    assert not (tmp_path / "sealed" / "manifest.json").exists()


def test_the_module_runs_as_a_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "installer", "seal", "--help"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert "--model-id" in result.stdout and "--signing-key" in result.stdout
