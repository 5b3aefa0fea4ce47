"""report_data binding: 64 bytes, deterministic, domain-separated, injective over its parts,
and refusing parts of the wrong size."""

from __future__ import annotations

import hashlib
import struct

import pytest

from attestation.binding import DOMAIN, BindingError, report_data

NONCE = bytes(range(32))
GPU_DIGEST = hashlib.sha256(b"gpu evidence").digest()
KEY = bytes(range(100, 132))


def test_report_data_is_the_documented_sha512_of_length_prefixed_parts() -> None:
    expected = hashlib.sha512(
        DOMAIN
        + struct.pack(">I", 32) + NONCE
        + struct.pack(">I", 32) + GPU_DIGEST
        + struct.pack(">I", 32) + KEY
    ).digest()  # fmt: skip
    assert report_data(NONCE, GPU_DIGEST, KEY) == expected
    assert len(expected) == 64


def test_report_data_known_answer() -> None:
    # Regenerate: python -c "from attestation.binding import report_data;
    #   print(report_data(bytes(32), bytes(32), b'\x01').hex())"
    assert report_data(bytes(32), bytes(32), b"\x01").hex() == (
        hashlib.sha512(
            DOMAIN + b"\0\0\0\x20" + bytes(32) + b"\0\0\0\x20" + bytes(32) + b"\0\0\0\x01\x01"
        ).hexdigest()
    )


@pytest.mark.parametrize(
    "changed",
    [
        (bytes(32), GPU_DIGEST, KEY),
        (NONCE, bytes(32), KEY),
        (NONCE, GPU_DIGEST, KEY + b"\0"),
        (NONCE, GPU_DIGEST, KEY[:-1]),
    ],
)
def test_report_data_changes_with_every_part(changed: tuple[bytes, bytes, bytes]) -> None:
    assert report_data(*changed) != report_data(NONCE, GPU_DIGEST, KEY)


@pytest.mark.parametrize(
    ("nonce", "digest", "key"),
    [
        (bytes(31), GPU_DIGEST, KEY),
        (bytes(33), GPU_DIGEST, KEY),
        (NONCE, bytes(48), KEY),
        (NONCE, GPU_DIGEST, b""),
    ],
)
def test_report_data_refuses_parts_of_the_wrong_size(
    nonce: bytes, digest: bytes, key: bytes
) -> None:
    with pytest.raises(BindingError):
        report_data(nonce, digest, key)
