"""`python -m installer trust-bundle` (installer/trust_bundle.py): the layout, a reproducible
manifest, signature and tar, an honest date (required, never in the future), and collateral
outside the layout refused with the store untouched (no OUT at all)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from attestation.trust_bundle import MANIFEST_NAME, SIGNATURE_NAME, format_created
from installer.__main__ import main
from tests.attestation.trust_bundles import build_trust_bundle, make_release_key

CREATED = datetime(2026, 11, 10, tzinfo=UTC)


@pytest.fixture
def collateral(tmp_path: Path) -> Path:
    source = tmp_path / "collateral"
    (source / "rims").mkdir(parents=True)
    (source / "rims" / "NV_GPU_DRIVER_GH100_550.90.07.swidtag").write_bytes(b"<rim/>")
    (source / "cpu" / "snp").mkdir(parents=True)
    (source / "cpu" / "snp" / "crl-genoa.der").write_bytes(b"crl")
    return source


def test_the_bundle_has_the_layout_and_the_same_inputs_give_the_same_bytes(
    tmp_path: Path, collateral: Path
) -> None:
    key, _ = make_release_key(tmp_path / "keys")
    first, second = (
        build_trust_bundle(tmp_path / name, key, CREATED, gpu_rims=collateral / "rims",
                           cpu_trust=collateral / "cpu", tar=True)
        for name in ("one", "two")
    )  # fmt: skip
    assert first.read_bytes() == second.read_bytes()
    manifest = json.loads((tmp_path / "one" / MANIFEST_NAME).read_bytes())
    assert manifest == {
        "format": "inferno-trust/1",
        "created": "2026-11-10T00:00:00Z",
        "files": [
            {"path": "cpu/snp/crl-genoa.der", "size": 3, "sha256": manifest["files"][0]["sha256"]},
            {"path": "gpu/rims/NV_GPU_DRIVER_GH100_550.90.07.swidtag", "size": 6,
             "sha256": manifest["files"][1]["sha256"]},
        ],
    }  # fmt: skip
    assert len((tmp_path / "one" / SIGNATURE_NAME).read_bytes()) == 64


def _build(tmp_path: Path, key: Path, *options: str | Path) -> int:
    """`python -m installer trust-bundle tmp_path/out --release-key KEY OPTIONS...`."""
    argv = ["trust-bundle", str(tmp_path / "out"), "--release-key", str(key)]
    return main([*argv, *map(str, options)])


def test_created_is_required(tmp_path: Path, collateral: Path) -> None:
    key, _ = make_release_key(tmp_path / "keys")
    with pytest.raises(SystemExit):
        main(["trust-bundle", str(tmp_path / "out"), "--release-key", str(key)])


def test_a_date_in_the_future_is_refused(
    tmp_path: Path, collateral: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, _ = make_release_key(tmp_path / "keys")
    tomorrow = format_created(datetime.now(UTC) + timedelta(days=1))
    status = _build(tmp_path, key, "--created", tomorrow, "--gpu-rims", collateral / "rims")
    assert status == 1
    assert "is in the future: give when it was gathered" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("rims/README", "'gpu/rims/README' is not a file of the trust bundle layout"),
        ("cpu/snp/extra/x.pem", "'cpu/snp/extra/x.pem' is not a file of the trust bundle layout"),
    ],
)
def test_collateral_outside_the_layout_is_refused_and_nothing_is_written(
    tmp_path: Path, collateral: Path, capsys: pytest.CaptureFixture[str], name: str, refused: str
) -> None:
    key, _ = make_release_key(tmp_path / "keys")
    (collateral / name).parent.mkdir(parents=True, exist_ok=True)
    (collateral / name).write_bytes(b"x")
    created = format_created(CREATED)
    sources = ("--gpu-rims", collateral / "rims", "--cpu-trust", collateral / "cpu")
    status = _build(tmp_path, key, "--created", created, *sources)
    assert status == 1
    assert refused in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["collateral", "keys"]


def test_a_symbolic_link_among_the_collateral_is_refused(
    tmp_path: Path, collateral: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, _ = make_release_key(tmp_path / "keys")
    os.symlink("/etc/passwd", collateral / "rims" / "link.swidtag")
    created = format_created(CREATED)
    status = _build(tmp_path, key, "--created", created, "--gpu-rims", collateral / "rims")
    assert status == 1
    assert "link.swidtag is not a regular file" in capsys.readouterr().err
