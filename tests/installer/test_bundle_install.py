"""The bundle's install.py: the pure-Python Ed25519 check, the manifest's and tar's bounds, every
tampered bundle refused (exit 2, one line naming the defect) before anything is written, and a
real install into a temporary prefix."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from installer import bundle_install
from installer.bundle import sign_bundle
from installer.bundle_install import (
    BundleRefused,
    ManifestEntry,
    check_relative_path,
    ed25519_verify,
    manifest_bytes,
    parse_manifest,
)
from tests.installer.bundles import (
    TINY_ARGV_LOG,
    TINY_GREETING,
    TINY_SEALED_WEIGHTS,
    TINY_TARGET,
    TINY_VERSION,
    BundleInputs,
    build_bundle,
    write_tiny_wheel,
)

# RFC 8032 section 7.1, TEST 2 (one-byte message).
RFC8032_PUBLIC = bytes.fromhex("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c")
RFC8032_MESSAGE = bytes.fromhex("72")
RFC8032_SIGNATURE = bytes.fromhex(
    "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
    "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"
)


def test_ed25519_verify_accepts_the_rfc8032_vector_and_rejects_a_flipped_bit() -> None:
    assert ed25519_verify(RFC8032_PUBLIC, RFC8032_MESSAGE, RFC8032_SIGNATURE)
    flipped = bytearray(RFC8032_SIGNATURE)
    flipped[5] ^= 1
    assert not ed25519_verify(RFC8032_PUBLIC, RFC8032_MESSAGE, bytes(flipped))
    assert not ed25519_verify(RFC8032_PUBLIC, b"\x73", RFC8032_SIGNATURE)


def test_ed25519_verify_agrees_with_cryptography_on_random_keys() -> None:
    for size in (0, 1, 64, 1000):
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        message = os.urandom(size)
        signature = key.sign(message)
        assert ed25519_verify(public, message, signature)
        other = Ed25519PrivateKey.generate().public_key()
        other_raw = other.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        assert not ed25519_verify(other_raw, message, signature)


def test_ed25519_verify_rejects_a_non_canonical_s() -> None:
    s = int.from_bytes(RFC8032_SIGNATURE[32:], "little") + bundle_install._L
    forged = RFC8032_SIGNATURE[:32] + s.to_bytes(32, "little")
    assert not ed25519_verify(RFC8032_PUBLIC, RFC8032_MESSAGE, forged)


@pytest.mark.parametrize(
    "path",
    ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a/./b", "a\\b", "", "a\x00b", "a/"],
)
def test_check_relative_path_refuses_paths_that_leave_or_are_not_normalised(path: str) -> None:
    with pytest.raises(BundleRefused):
        check_relative_path(path, "test")


GOOD_ENTRY = {"path": "install.py", "sha256": "ab" * 32, "size": 3}


def _manifest(**changes: object) -> bytes:
    document: dict[str, object] = {
        "format": "inferno-bundle/1",
        "version": "0.1.0",
        "target": TINY_TARGET,
        "files": [GOOD_ENTRY],
    }
    document.update(changes)
    return json.dumps(document).encode()


def test_parse_manifest_reads_what_manifest_bytes_writes() -> None:
    entries = [ManifestEntry("b", "cd" * 32, 1), ManifestEntry("a/x", "ab" * 32, 0)]
    manifest = parse_manifest(manifest_bytes("0.1.0", TINY_TARGET, entries))
    assert manifest.files == tuple(sorted(entries, key=lambda e: e.path))
    assert (manifest.version, manifest.target) == ("0.1.0", TINY_TARGET)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"[" * 100_000, "not valid JSON"),
        (b"\xff", "not valid JSON"),
        (_manifest(format="inferno-bundle/2"), "is format"),
        (_manifest(extra=1), "does not have the fields"),
        (_manifest(version="../1"), "the version is not a plain name"),
        (_manifest(files=[GOOD_ENTRY, GOOD_ENTRY]), "listed twice"),
        (_manifest(files=[{**GOOD_ENTRY, "path": "MANIFEST.sig"}]), "reserved"),
        (_manifest(files=[{**GOOD_ENTRY, "sha256": "AB" * 32}]), "64 lowercase hex"),
        (_manifest(files=[{**GOOD_ENTRY, "size": -1}]), "non-negative integer"),
        (_manifest(files=[{**GOOD_ENTRY, "size": True}]), "non-negative integer"),
        (_manifest(files=[{"path": "x"}]), "without path, sha256 and size"),
    ],
)
def test_parse_manifest_refuses_malformed_manifests(raw: bytes, expected: str) -> None:
    with pytest.raises(BundleRefused, match=re.escape(expected)):
        parse_manifest(raw)


# ---- refusals: each before anything is written, each with its own message ----------------


def _copy(built_bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(built_bundle, copy, symlinks=True)
    return copy


def _install(
    bundle: Path, public_key: Path, prefix: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """install.py with the operator's TLS pair (the tiny wheel cannot make a self-signed one)."""
    tls = prefix.parent / "operator-tls"
    tls.mkdir(exist_ok=True)
    for name in ("server.crt", "server.key"):
        (tls / name).write_text(f"{name} of the operator\n")
    command = [sys.executable, str(bundle / "install.py"), "--release-key-pub", str(public_key)]
    command += ["--prefix", str(prefix), "--no-systemd", *extra]
    command += ["--tls-cert", str(tls / "server.crt"), "--tls-key", str(tls / "server.key")]
    return subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=120, env=env
    )


def _snapshot(directory: Path) -> list[tuple[str, bytes]]:
    return sorted(
        (p.relative_to(directory).as_posix(), p.read_bytes() if p.is_file() else b"")
        for p in directory.rglob("*")
    )


def _assert_refused(
    bundle: Path, inputs: BundleInputs, tmp_path: Path, expected: str, *extra: str
) -> None:
    """install.py exits 2 with one line holding `expected`; an existing prefix is untouched."""
    prefix = tmp_path / "prefix"
    (prefix / "etc").mkdir(parents=True)
    (prefix / "etc" / "keep.txt").write_text("the operator's\n")
    before = _snapshot(prefix)
    result = _install(bundle, inputs.public_key, prefix, *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert _snapshot(prefix) == before
    fresh = tmp_path / "fresh-prefix"
    assert _install(bundle, inputs.public_key, fresh, *extra).returncode == 2
    assert not fresh.exists()


def test_install_refuses_a_modified_wheel(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    wheel = bundle / "wheels" / f"inferno-{TINY_VERSION}-py3-none-any.whl"
    data = bytearray(wheel.read_bytes())
    data[-10] ^= 0xFF
    wheel.write_bytes(bytes(data))
    expected = f"wheels/inferno-{TINY_VERSION}-py3-none-any.whl has the wrong SHA-256"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_modified_sealed_chunk(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    """One byte of one chunk's ciphertext changed, the size the same: the bundle's digest
    catches it at install, long before the chunk's GCM tag would at the first start."""
    bundle = _copy(built_bundle, tmp_path)
    sealed = bundle / "models" / "tiny-model" / TINY_SEALED_WEIGHTS
    data = bytearray(sealed.read_bytes())
    data[len(data) // 2] ^= 0x01
    sealed.write_bytes(bytes(data))
    expected = f"models/tiny-model/{TINY_SEALED_WEIGHTS} has the wrong SHA-256"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_sealed_file_cut_short(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    sealed = bundle / "models" / "tiny-model" / TINY_SEALED_WEIGHTS
    sealed.write_bytes(sealed.read_bytes()[:-4112])  # one whole chunk and its tag gone
    expected = f"models/tiny-model/{TINY_SEALED_WEIGHTS} has the wrong size"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_removed_file(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    (bundle / "models" / "tiny-model" / "config.json").unlink()
    expected = "models/tiny-model/config.json is in the manifest but missing"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_an_added_file(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    (bundle / "wheels" / "extra-1.0-py3-none-any.whl").write_bytes(b"PK")
    expected = "wheels/extra-1.0-py3-none-any.whl is not in the manifest"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_manifest_signed_by_another_key(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    sign_bundle(bundle, Ed25519PrivateKey.generate(), version=TINY_VERSION, target=TINY_TARGET)
    expected = "MANIFEST.sig does not verify against the given release key"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_manifest_edited_after_signing(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    manifest = bundle / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"0.1.0"', b'"0.1.1"'))
    _assert_refused(bundle, bundle_inputs, tmp_path, "MANIFEST.sig does not verify")


def test_install_refuses_a_signed_manifest_naming_a_path_outside_the_bundle(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    manifest = bundle / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"install.py"', b'"../install.py"'))
    key = serialization.load_pem_private_key(bundle_inputs.private_key.read_bytes(), None)
    (bundle / "MANIFEST.sig").write_bytes(key.sign(manifest.read_bytes()))  # type: ignore[call-arg, union-attr]
    _assert_refused(bundle, bundle_inputs, tmp_path, 'path "../install.py" leaves the bundle')


def test_install_refuses_a_symlink_pointing_outside_the_bundle(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    bundle = _copy(built_bundle, tmp_path)
    weights = bundle / "models" / "tiny-model" / TINY_SEALED_WEIGHTS
    outside = tmp_path / "outside.bin"
    shutil.copyfile(weights, outside)
    weights.unlink()
    weights.symlink_to(outside)
    expected = f"models/tiny-model/{TINY_SEALED_WEIGHTS} is a symbolic link"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_truncated_tar(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    data = built_bundle.with_name("bundle.tar").read_bytes()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(data[: len(data) // 2])
    _assert_refused(
        built_bundle,
        bundle_inputs,
        tmp_path,
        "truncated.tar is truncated",
        "--from-tar",
        str(truncated),
    )


def _tar_with(tmp_path: Path, built_bundle: Path, extra: tarfile.TarInfo, data: bytes) -> Path:
    """The built bundle's tar with one more member appended."""
    path = tmp_path / "hostile.tar"
    shutil.copyfile(built_bundle.with_name("bundle.tar"), path)
    with tarfile.open(path, "a", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(extra, io.BytesIO(data) if extra.isreg() else None)
    return path


def test_install_refuses_a_path_traversal_name_in_the_tar(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    member = tarfile.TarInfo("../../escaped.txt")
    member.size = 3
    hostile = _tar_with(tmp_path, built_bundle, member, b"hi\n")
    expected = 'path "../../escaped.txt" leaves the bundle'
    _assert_refused(built_bundle, bundle_inputs, tmp_path, expected, "--from-tar", str(hostile))
    assert not (tmp_path.parent / "escaped.txt").exists()


def test_install_refuses_a_symlink_member_in_the_tar(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    member = tarfile.TarInfo("models/tiny-model/link")
    member.type = tarfile.SYMTYPE
    member.linkname = "/etc/passwd"
    hostile = _tar_with(tmp_path, built_bundle, member, b"")
    expected = "member models/tiny-model/link is a link"
    _assert_refused(built_bundle, bundle_inputs, tmp_path, expected, "--from-tar", str(hostile))


def test_install_refuses_a_device_member_in_the_tar(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    member = tarfile.TarInfo("wheels/null")
    member.type = tarfile.CHRTYPE
    hostile = _tar_with(tmp_path, built_bundle, member, b"")
    expected = "member wheels/null is not a regular file"
    _assert_refused(built_bundle, bundle_inputs, tmp_path, expected, "--from-tar", str(hostile))


def test_install_refuses_a_bundle_for_another_python(
    bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    other = f"linux-x86_64-py3.{sys.version_info.minor + 1}-cpu"
    bundle = build_bundle(bundle_inputs, tmp_path / "other-python", tar=False, target=other)
    expected = f"the bundle is for Python 3.{sys.version_info.minor + 1} ({other})"
    _assert_refused(bundle, bundle_inputs, tmp_path, expected)


def test_install_refuses_a_public_key_that_is_not_ed25519_pem(
    built_bundle: Path, tmp_path: Path
) -> None:
    bogus = tmp_path / "key.pub"
    bogus.write_text("not a key\n")
    result = _install(built_bundle, bogus, tmp_path / "prefix")
    assert result.returncode == 2
    assert "not a PEM public key" in result.stderr
    assert not (tmp_path / "prefix").exists()


# ---- a real install ----------------------------------------------------------------------


def test_install_from_tar_makes_a_release_the_current_link_and_the_config(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    prefix = tmp_path / "prefix"
    # install.py taken out of the tar alone, as an operator does before installing from it.
    with tarfile.open(built_bundle.with_name("bundle.tar")) as tar:
        script = tar.extractfile("install.py")
        assert script is not None
        (tmp_path / "install.py").write_bytes(script.read())
    argv_log = tmp_path / "inferno-argv.jsonl"
    result = _install(
        tmp_path,
        bundle_inputs.public_key,
        prefix,
        "--from-tar",
        str(built_bundle) + ".tar",
        env={**os.environ, TINY_ARGV_LOG: str(argv_log)},
    )
    assert result.returncode == 0, result.stderr
    command = Path(result.stdout.strip().splitlines()[-1])
    assert command == prefix / "current" / "bin" / "inferno"
    assert os.readlink(prefix / "current") == f"releases/{TINY_VERSION}"
    ran = subprocess.run([command], capture_output=True, text=True, check=True, env={})
    assert ran.stdout.strip() == TINY_GREETING
    release = prefix / "releases" / TINY_VERSION
    model = release / "models" / "tiny-model" / TINY_SEALED_WEIGHTS
    assert model.read_bytes() == (bundle_inputs.model / TINY_SEALED_WEIGHTS).read_bytes()
    config = (prefix / "etc" / "inferno.toml").read_text()
    assert f'dir = "{prefix}/data/models/SmolLM2-135M-Instruct"' in config
    assert "@PREFIX@" not in config
    key = prefix / "etc" / "tls" / "server.key"
    assert key.read_text() == "server.key of the operator\n"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # The release key that verified the bundle, where tee.trust_release_key points: trust
    # bundles are verified under it. Public, so the service reads it.
    release_key = prefix / "etc" / "release-key.pub"
    assert release_key.read_bytes() == bundle_inputs.public_key.read_bytes()
    assert stat.S_IMODE(release_key.stat().st_mode) == 0o644
    assert f'trust_release_key = "{release_key}"' in config
    # The release's own command recorded the install (a production config is not checked
    # until the operator fills it in: no `config check`).
    digest = hashlib.sha256((built_bundle / "MANIFEST.json").read_bytes()).hexdigest()
    recorded = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert recorded == [
        [
            *("admin", "record-install", "--config", str(prefix / "etc" / "inferno.toml")),
            *("--action", "install", "--version", TINY_VERSION, "--bundle-digest", digest),
            *("--who", bundle_install.installing_user()),
        ]
    ]

    # The same version again: refused, the installed release kept as it was.
    before = _snapshot(prefix / "etc")
    again = _install(built_bundle, bundle_inputs.public_key, prefix)
    assert again.returncode == 2
    assert "already exists" in again.stderr
    assert "upgrade" in again.stderr
    assert _snapshot(prefix / "etc") == before
    assert os.readlink(prefix / "current") == f"releases/{TINY_VERSION}"


def test_install_that_fails_in_pip_removes_what_it_made(
    bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    write_tiny_wheel(wheelhouse, requires=("not-in-the-wheelhouse>=1",))
    inputs = BundleInputs(bundle_inputs.keys, wheelhouse, bundle_inputs.model)
    bundle = build_bundle(inputs, tmp_path / "bundle", tar=False)
    prefix = tmp_path / "prefix"
    (prefix / "releases").mkdir(parents=True)
    before = _snapshot(prefix)
    result = _install(bundle, inputs.public_key, prefix)
    assert result.returncode == 2
    assert "pip install --no-index failed" in result.stderr
    assert "not-in-the-wheelhouse" in result.stderr
    assert _snapshot(prefix) == before


def test_install_loads_the_bundles_trust_directory_through_the_release_before_recording(
    bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    trust = tmp_path / "trust-bundle"
    (trust / "gpu").mkdir(parents=True)
    (trust / "gpu" / "root.pem").write_text("a pinned root\n")
    bundle = build_bundle(
        bundle_inputs, tmp_path / "bundle", tar=False, extra=("--trust-bundle", str(trust))
    )
    assert (bundle / "trust" / "gpu" / "root.pem").read_text() == "a pinned root\n"
    assert '"trust/gpu/root.pem"' in (bundle / "MANIFEST.json").read_text()
    argv_log = tmp_path / "inferno-argv.jsonl"
    prefix = tmp_path / "prefix"
    result = _install(
        bundle, bundle_inputs.public_key, prefix, env={**os.environ, TINY_ARGV_LOG: str(argv_log)}
    )
    assert result.returncode == 0, result.stderr
    commands = [json.loads(line)[:2] for line in argv_log.read_text().splitlines()]
    assert commands == [["trust", "update"], ["admin", "record-install"]]
    trust_update = json.loads(argv_log.read_text().splitlines()[0])
    # The verified private copy of the bundle, not the directory install.py was run from.
    assert trust_update[2].endswith("/bundle/trust") and not trust_update[2].startswith(
        str(tmp_path)
    )
    assert trust_update[3:] == ["--config", str(prefix / "etc" / "inferno.toml")]


def test_release_versions_are_ordered_by_their_numbers_and_unordered_ones_refused() -> None:
    key = bundle_install.release_version_key
    assert key("0.2.10") > key("0.2.9") > key("0.2") > key("0.1.99")
    # A tie on the numbers is not newer: an upgrade between 1.0rc1 and 1.0 is refused.
    assert key("1.0rc1") == key("1.0")
    with pytest.raises(bundle_install.InstallFailed, match="does not start with a number"):
        key("nightly")


def test_install_refuses_a_prefix_it_could_not_write_unquoted(
    built_bundle: Path, bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    prefix = tmp_path / 'odd "prefix"'
    result = _install(built_bundle, bundle_inputs.public_key, prefix)
    assert result.returncode == 2
    assert "may hold only letters, digits and / . _ -" in result.stderr
    assert not prefix.exists()


def test_a_cuda_bundle_brings_its_triton_kernels_into_the_data_directory(
    bundle_inputs: BundleInputs, tmp_path: Path
) -> None:
    """The kernels `inferno warmup` compiled on the target's GPU go to DIR/data/triton-cache,
    where the templates' engine.triton_cache_dir points; an entry already there is kept."""
    cache = tmp_path / "triton-cache"
    for key in ("KEYAAAA", "KEYBBBB"):
        (cache / key).mkdir(parents=True)
        (cache / key / "kernel.cubin").write_bytes(key.encode() * 8)
    target = TINY_TARGET.replace("-cpu", "-cuda")
    bundle = build_bundle(
        bundle_inputs, tmp_path / "cuda-bundle", tar=False, target=target,
        extra=("--triton-cache", str(cache)),
    )  # fmt: skip
    prefix = tmp_path / "prefix"
    kept = prefix / "data" / "triton-cache" / "KEYAAAA"
    kept.mkdir(parents=True)
    (kept / "kernel.cubin").write_bytes(b"compiled here")
    result = _install(bundle, bundle_inputs.public_key, prefix)
    assert result.returncode == 0, result.stderr
    installed = prefix / "data" / "triton-cache"
    assert (installed / "KEYBBBB" / "kernel.cubin").read_bytes() == b"KEYBBBB" * 8
    assert (installed / "KEYAAAA" / "kernel.cubin").read_bytes() == b"compiled here"
    config = (prefix / "etc" / "inferno.toml").read_text()
    assert f'triton_cache_dir = "{installed}"' in config
