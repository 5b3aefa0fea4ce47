"""Trust bundles (attestation/trust_bundle.py): a bundle the release key signed verifies, and
each kind of tampering is refused at its own step with its own message: a modified, added or
removed file, another key, a link, a name outside the layout; and in a tar, a name that climbs
out, a link member, a truncated file."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestation.errors import TrustBundleError
from attestation.trust_bundle import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    extract_trust_bundle_tar,
    load_release_public_key,
    parse_created,
    verify_trust_bundle,
)
from installer.bundle import load_release_key
from tests.attestation.trust_bundles import build_trust_bundle, make_release_key

CREATED = datetime(2026, 11, 10, tzinfo=UTC)
RIM = "gpu/rims/NV_GPU_DRIVER_GH100_550.90.07.swidtag"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_release_key(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path]) -> Path:
    """A bundle with RIMs, revocation data and CPU collateral (their bytes are not parsed
    here: the format carries files, the verifiers of attestation.gpu and .cpu judge them)."""
    source = tmp_path_factory.mktemp("collateral")
    (source / "rims").mkdir()
    (source / "rims" / Path(RIM).name).write_bytes(b"<rim driver/>")
    (source / "rims" / "G520_0200_885_9600.swidtag").write_bytes(b"<rim vbios/>")
    (source / "revocation").mkdir()
    (source / "revocation" / "device.ocsp").write_bytes(b"ocsp")
    (source / "cpu" / "tdx" / "collateral").mkdir(parents=True)
    (source / "cpu" / "tdx" / "collateral" / "90c06f000000.json").write_text("{}")
    return build_trust_bundle(
        tmp_path_factory.mktemp("built") / "trust",
        keys[0],
        CREATED,
        gpu_rims=source / "rims",
        gpu_revocation=source / "revocation",
        cpu_trust=source / "cpu",
    )


@pytest.fixture
def bundle(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built bundle, for a test to tamper with."""
    return Path(shutil.copytree(built, tmp_path / "trust"))


def _verify(bundle: Path, keys: tuple[Path, Path]) -> None:
    verify_trust_bundle(bundle, load_release_public_key(keys[1]))


def test_a_signed_bundle_verifies_with_its_digest_and_date(
    bundle: Path, keys: tuple[Path, Path]
) -> None:
    verified = verify_trust_bundle(bundle, load_release_public_key(keys[1]))
    manifest = (bundle / MANIFEST_NAME).read_bytes()
    assert verified.id.digest == hashlib.sha256(manifest).hexdigest()
    assert verified.id.created == CREATED
    assert verified.id.to_json() == {
        "digest": verified.id.digest,
        "created": "2026-11-10T00:00:00Z",
    }
    assert [entry.path for entry in verified.files] == [
        "cpu/tdx/collateral/90c06f000000.json",
        "gpu/revocation/device.ocsp",
        "gpu/rims/G520_0200_885_9600.swidtag",
        RIM,
    ]
    assert verified.gpu_rims_dir == bundle / "gpu" / "rims"


def test_verify_rejects_a_modified_file(bundle: Path, keys: tuple[Path, Path]) -> None:
    (bundle / RIM).write_bytes(b"<rim driver=forged/>")
    with pytest.raises(TrustBundleError, match=f"^{RIM} has the wrong SHA-256"):
        _verify(bundle, keys)


def test_verify_rejects_an_added_file(bundle: Path, keys: tuple[Path, Path]) -> None:
    (bundle / "gpu" / "rims" / "extra.swidtag").write_bytes(b"<rim/>")
    with pytest.raises(TrustBundleError, match=r"extra.swidtag is not in the manifest"):
        _verify(bundle, keys)


def test_verify_rejects_a_removed_file(bundle: Path, keys: tuple[Path, Path]) -> None:
    (bundle / "gpu" / "revocation" / "device.ocsp").unlink()
    with pytest.raises(TrustBundleError, match=r"device.ocsp is in the manifest but missing"):
        _verify(bundle, keys)


def test_verify_rejects_a_bundle_signed_by_another_key(
    bundle: Path, keys: tuple[Path, Path], tmp_path: Path
) -> None:
    _, other = make_release_key(tmp_path / "other")
    with pytest.raises(TrustBundleError, match="does not verify against the release key"):
        verify_trust_bundle(bundle, load_release_public_key(other))


def test_verify_rejects_a_manifest_changed_after_signing(
    bundle: Path, keys: tuple[Path, Path]
) -> None:
    manifest = (bundle / MANIFEST_NAME).read_text()
    (bundle / MANIFEST_NAME).write_text(manifest.replace("2026-11-10", "2026-12-10"))
    with pytest.raises(TrustBundleError, match="does not verify against the release key"):
        _verify(bundle, keys)


def test_verify_rejects_a_symbolic_link_wherever_it_points(
    bundle: Path, keys: tuple[Path, Path]
) -> None:
    (bundle / RIM).unlink()
    os.symlink(bundle / "gpu" / "rims" / "G520_0200_885_9600.swidtag", bundle / RIM)
    with pytest.raises(TrustBundleError, match=f"^{RIM} is a symbolic link"):
        _verify(bundle, keys)


def test_verify_rejects_a_link_to_a_bundle(bundle: Path, keys: tuple[Path, Path]) -> None:
    os.symlink(bundle, bundle.with_name("link"))
    with pytest.raises(TrustBundleError, match="link is a symbolic link: name the bundle itself"):
        _verify(bundle.with_name("link"), keys)


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("gpu/rims/notes.txt", "'gpu/rims/notes.txt' is not a file of the trust bundle layout"),
        ("install.py", "'install.py' is not a file of the trust bundle layout"),
        ("gpu/rims/sub/x.swidtag", "gpu/rims/sub/ is not a directory of the layout"),
    ],
)
def test_verify_rejects_a_file_outside_the_layout(
    bundle: Path, keys: tuple[Path, Path], name: str, refused: str
) -> None:
    (bundle / name).parent.mkdir(parents=True, exist_ok=True)
    (bundle / name).write_bytes(b"x")
    with pytest.raises(TrustBundleError, match=refused):
        _verify(bundle, keys)


def test_a_signed_manifest_naming_a_path_that_climbs_out_is_refused(
    bundle: Path, keys: tuple[Path, Path]
) -> None:
    """Even the release key cannot make the appliance read outside the bundle."""
    document = json.loads((bundle / MANIFEST_NAME).read_bytes())
    document["files"][0]["path"] = "gpu/rims/../../../etc/passwd.xml"
    raw = json.dumps(document).encode()
    (bundle / MANIFEST_NAME).write_bytes(raw)
    (bundle / SIGNATURE_NAME).write_bytes(load_release_key(keys[0]).sign(raw))
    with pytest.raises(TrustBundleError, match="is not a file of the trust bundle layout"):
        _verify(bundle, keys)


def test_a_signed_manifest_listing_a_file_twice_is_refused(
    bundle: Path, keys: tuple[Path, Path]
) -> None:
    document = json.loads((bundle / MANIFEST_NAME).read_bytes())
    document["files"].append(document["files"][-1])
    raw = json.dumps(document).encode()
    (bundle / MANIFEST_NAME).write_bytes(raw)
    (bundle / SIGNATURE_NAME).write_bytes(load_release_key(keys[0]).sign(raw))
    with pytest.raises(TrustBundleError, match="not sorted, or one is listed twice"):
        _verify(bundle, keys)


def test_a_release_key_that_is_not_ed25519_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "release-key.pub"
    path.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(TrustBundleError, match="is not a PEM public key"):
        load_release_public_key(path)


@pytest.mark.parametrize(
    "text",
    ["2026-11-10", "2026-11-10T00:00:00+00:00", "2026-11-10T00:00:00.5Z", "2026-02-30T00:00:00Z"],
)
def test_created_is_only_rfc3339_utc_whole_seconds(text: str) -> None:
    with pytest.raises(TrustBundleError, match="created"):
        parse_created(text)


# ---- tars -------------------------------------------------------------------------------


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def test_a_built_tar_extracts_to_a_bundle_that_verifies(
    tmp_path: Path, keys: tuple[Path, Path], built: Path
) -> None:
    tar_path = build_trust_bundle(
        tmp_path / "t", keys[0], CREATED, gpu_rims=built / "gpu" / "rims", tar=True
    )
    (tmp_path / "out").mkdir()
    extract_trust_bundle_tar(tar_path, tmp_path / "out")
    _verify(tmp_path / "out", keys)


@pytest.mark.parametrize(
    ("members", "refused"),
    [
        ([(_file("../evil.xml"), b"x")], "'../evil.xml' is not a file of the trust bundle layout"),
        (
            [(_file("gpu/rims/../../../evil.xml"), b"x")],
            "is not a file of the trust bundle layout",
        ),
        ([(_file("/etc/evil.xml"), b"x")], "'/etc/evil.xml' is not a file of the trust bundle"),
        ([(_link(RIM, "/etc/passwd"), b"")], f"{RIM} is a link or special file"),
        ([(_file(RIM), b"a"), (_file(RIM), b"b")], "holds a member twice"),
    ],
    ids=["parent", "climbs-out", "absolute", "symlink", "twice"],
)
def test_extract_refuses_a_hostile_tar_member(
    tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]], refused: str
) -> None:
    tar_path = _tar(tmp_path / "hostile.tar", members)
    (tmp_path / "out").mkdir()
    with pytest.raises(TrustBundleError, match=refused):
        extract_trust_bundle_tar(tar_path, tmp_path / "out")
    assert not (tmp_path / "evil.xml").exists()


def test_extract_refuses_a_truncated_tar(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    big = tmp_path / "rims"
    big.mkdir()
    (big / "big.swidtag").write_bytes(os.urandom(100_000))
    tar_path = build_trust_bundle(tmp_path / "t", keys[0], CREATED, gpu_rims=big, tar=True)
    data = tar_path.read_bytes()
    tar_path.write_bytes(data[: len(data) // 2])
    (tmp_path / "out").mkdir()
    with pytest.raises(TrustBundleError, match="is truncated"):
        extract_trust_bundle_tar(tar_path, tmp_path / "out")
