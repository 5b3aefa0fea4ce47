"""report_data binding, v1 and v2: 64 bytes, deterministic, domain-separated, injective over its
parts, and refusing parts of the wrong size."""

from __future__ import annotations

import hashlib
import struct

import pytest

from attestation.binding import (
    DOMAIN,
    DOMAIN_V2,
    NO_CHANNEL,
    BindingError,
    Channel,
    report_data,
    report_data_v2,
)

NONCE = bytes(range(32))
GPU_DIGEST = hashlib.sha256(b"gpu evidence").digest()
KEY = bytes(range(100, 132))
SPKI = hashlib.sha256(b"a SubjectPublicKeyInfo").digest()
VKEY = "inferno.test/log+0a1b2c3d+AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA="
CHANNEL = Channel(SPKI, VKEY)


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


def test_report_data_v2_is_the_documented_sha512_of_five_length_prefixed_parts() -> None:
    # Regenerate: the same formula, as docs/ATTESTATION.md ("Binding") writes it.
    vkey = VKEY.encode()
    expected = hashlib.sha512(
        DOMAIN_V2
        + struct.pack(">I", 32) + NONCE
        + struct.pack(">I", 32) + GPU_DIGEST
        + struct.pack(">I", 32) + KEY
        + struct.pack(">I", 32) + SPKI
        + struct.pack(">I", len(vkey)) + vkey
    ).digest()  # fmt: skip
    assert report_data_v2(NONCE, GPU_DIGEST, KEY, CHANNEL) == expected


def test_v2_never_equals_v1_and_an_absent_channel_part_is_empty() -> None:
    assert report_data_v2(NONCE, GPU_DIGEST, KEY, NO_CHANNEL) != report_data(NONCE, GPU_DIGEST, KEY)
    assert report_data_v2(NONCE, GPU_DIGEST, KEY, NO_CHANNEL) == hashlib.sha512(
        DOMAIN_V2 + b"".join(struct.pack(">I", 32) + p for p in (NONCE, GPU_DIGEST, KEY))
        + struct.pack(">I", 0) * 2
    ).digest()  # fmt: skip


@pytest.mark.parametrize(
    "channel",
    [
        Channel(bytes(32), VKEY),
        Channel(SPKI, VKEY + "x"),
        Channel(None, VKEY),
        Channel(SPKI, None),
    ],
)
def test_report_data_v2_changes_with_the_tls_key_and_the_audit_vkey(channel: Channel) -> None:
    assert report_data_v2(NONCE, GPU_DIGEST, KEY, channel) != report_data_v2(
        NONCE, GPU_DIGEST, KEY, CHANNEL
    )


@pytest.mark.parametrize(
    ("spki", "vkey"), [(bytes(31), VKEY), (bytes(48), VKEY), (SPKI, ""), (SPKI, "v" * 1025)]
)
def test_a_channel_with_a_part_of_the_wrong_size_is_refused(spki: bytes, vkey: str) -> None:
    with pytest.raises(BindingError):
        Channel(spki, vkey)
