"""Challenges: fresh, strictly parsed, and the GPU nonces a client can recompute from its own."""

from __future__ import annotations

import hashlib

import pytest

from appliance.attestation.challenge import gpu_nonces, new_challenge, parse_challenge


def test_each_challenge_is_32_fresh_bytes() -> None:
    challenges = {new_challenge() for _ in range(100)}
    assert len(challenges) == 100
    assert {len(c) for c in challenges} == {32}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("00" * 31, "32 bytes"),
        ("00" * 33, "32 bytes"),
        ("zz" * 32, "hexadecimal"),
        ("", "32 bytes"),
    ],
)
def test_a_nonce_that_is_not_32_hex_bytes_is_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_challenge(text)


def test_gpu_nonces_are_distinct_per_gpu_and_follow_the_documented_formula() -> None:
    challenge = bytes(range(32))
    nonces = gpu_nonces(challenge, 8)
    assert len(set(nonces)) == 8
    expected = hashlib.sha256(b"inferno.gpu-nonce.v1\x00" + challenge + (3).to_bytes(4, "big"))
    assert nonces[3] == expected.digest()
    assert gpu_nonces(challenge, 2) == nonces[:2]
    assert gpu_nonces(bytes(32), 1) != nonces[:1]
