"""Step 2: a manifest whose signature verifies (the signer's key is the test's) but whose content
is malformed is refused by name, never half-read. A hostile corpus named by defect."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from attestation.sealed import SealedModel, load_manifest_public_key
from attestation.sealed.errors import ManifestFormatError, ManifestSignatureError
from attestation.sealed.manifest import MAX_MANIFEST_BYTES, SealedManifest
from tests.attestation.sealed.conftest import SealedFixture

SHARD_1 = "model-00001-of-00002.safetensors"


def _resign(fixture: SealedFixture, change: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads((fixture.sealed / "manifest.json").read_bytes())
    change(document)
    body = json.dumps(document).encode()
    signature = fixture.signing_key.sign(b"inferno-sealed-model/1 manifest\n" + body)
    (fixture.sealed / "manifest.json").write_bytes(body)
    (fixture.sealed / "manifest.sig").write_bytes(base64.b64encode(signature))


def _shard(document: dict[str, Any]) -> dict[str, Any]:
    return next(entry for entry in document["files"] if entry["name"] == SHARD_1)


HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "unknown_format_version": (
        lambda d: d.update(format="inferno-sealed-model/2"),
        "this appliance reads",
    ),
    "unknown_top_level_key": (lambda d: d.update(comment="hi"), "unknown keys"),
    "missing_key_id": (lambda d: d.pop("key_id"), "lacks"),
    "chunk_size_zero": (lambda d: d.update(chunk_size=0), "chunk_size 0 is outside"),
    "chunk_size_as_string": (lambda d: d.update(chunk_size="4096"), "non-negative integer"),
    "seal_id_too_short": (lambda d: d.update(seal_id="00"), "seal_id must be 32"),
    "wrapped_key_not_base64": (lambda d: d.update(wrapped_key="@@@"), "not base64"),
    "no_files": (lambda d: d.update(files=[]), "lists no files"),
    "path_traversal_name": (lambda d: _shard(d).update(name="../x.safetensors"), "plain file"),
    "name_in_subdirectory": (lambda d: _shard(d).update(name="a/b.safetensors"), "plain file"),
    "hidden_name": (lambda d: _shard(d).update(name=".x.safetensors"), "plain file"),
    "duplicate_name": (lambda d: d["files"].append(dict(_shard(d))), "twice"),
    "chunk_count_understated": (
        lambda d: _shard(d).update(num_chunks=_shard(d)["num_chunks"] - 1),
        "does not match size",
    ),
    "weights_listed_plain": (
        lambda d: (_shard(d).update(sealed=False), _shard(d).pop("num_chunks")),
        "must be sealed",
    ),
    "sealed_non_weight_file": (
        lambda d: next(e for e in d["files"] if e["name"] == "config.json").update(
            sealed=True, num_chunks=1
        ),
        "only \\*.safetensors",
    ),
    "negative_size": (lambda d: _shard(d).update(size=-1), "non-negative integer"),
    "boolean_size": (lambda d: _shard(d).update(size=True), "non-negative integer"),
    "uppercase_digest": (lambda d: _shard(d).update(sha256="A" * 64), "lowercase hex"),
    "manifest_named_as_a_file": (
        lambda d: next(e for e in d["files"] if e["name"] == "config.json").update(
            name="manifest.json"
        ),
        "collides",
    ),
    "no_sealed_file": (
        lambda d: d.update(files=[e for e in d["files"] if not e["sealed"]]),
        "no sealed weight file",
    ),
}


@pytest.mark.parametrize("defect", sorted(HOSTILE))
def test_a_signed_but_malformed_manifest_is_refused(sealed: SealedFixture, defect: str) -> None:
    change, message = HOSTILE[defect]
    _resign(sealed, change)
    with pytest.raises(ManifestFormatError, match=message):
        SealedModel.open(sealed.sealed, manifest_key=sealed.public_key)


def test_a_signed_manifest_that_is_not_json_is_refused(sealed: SealedFixture) -> None:
    body = b"\xff not json"
    signature = sealed.signing_key.sign(b"inferno-sealed-model/1 manifest\n" + body)
    with pytest.raises(ManifestFormatError, match="not JSON"):
        SealedManifest.verify_and_parse(body, base64.b64encode(signature), sealed.public_key)


def test_the_signature_is_domain_separated(sealed: SealedFixture) -> None:
    """A signature by the same key over the bare manifest (say, made for another purpose) does
    not verify as a manifest signature."""
    body = (sealed.sealed / "manifest.json").read_bytes()
    (sealed.sealed / "manifest.sig").write_bytes(base64.b64encode(sealed.signing_key.sign(body)))
    with pytest.raises(ManifestSignatureError, match="does not verify"):
        SealedModel.open(sealed.sealed, manifest_key=sealed.public_key)


def test_the_manifest_round_trips_through_its_canonical_bytes(sealed: SealedFixture) -> None:
    body, signature = sealed.manifest.sign(sealed.signing_key)
    assert body == (sealed.sealed / "manifest.json").read_bytes()
    assert SealedManifest.verify_and_parse(body, signature, sealed.public_key) == sealed.manifest


def test_the_public_key_loads_from_pem(sealed: SealedFixture, tmp_path: Path) -> None:
    path = tmp_path / "manifest.pub"
    pem = sealed.public_key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    path.write_bytes(pem)
    assert load_manifest_public_key(path) == sealed.public_key


def _sign(sealed: SealedFixture, body: bytes) -> bytes:
    return base64.b64encode(sealed.signing_key.sign(b"inferno-sealed-model/1 manifest\n" + body))


def test_a_signed_manifest_100000_levels_deep_is_refused(sealed: SealedFixture) -> None:
    """Issue 13, defect 2: even a manifest the pinned key signed is parsed within limits."""
    body = b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ManifestFormatError, match="deeper than 64 levels"):
        SealedManifest.verify_and_parse(body, _sign(sealed, body), sealed.public_key)


def test_a_signed_manifest_over_its_size_limit_is_refused(sealed: SealedFixture) -> None:
    body = b" " * (MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ManifestFormatError, match="over the limit of 16777216 bytes"):
        SealedManifest.verify_and_parse(body, _sign(sealed, body), sealed.public_key)
