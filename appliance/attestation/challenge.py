"""Challenges and what is derived from them: one 32-byte challenge per attestation, from which
each GPU's SPDM nonce is derived, and to which the CPU report is bound (with the GPU evidence
digest and the appliance's attestation key) through `attestation.binding.report_data`.

Deriving the GPU nonces, rather than drawing one per GPU, lets a client that sent one nonce to
`/v1/attestation` recompute every nonce it must find in the GPU reports.
"""

from __future__ import annotations

import hashlib
import secrets

CHALLENGE_LEN = 32
_GPU_NONCE_CONTEXT = b"inferno.gpu-nonce.v1\x00"


def new_challenge() -> bytes:
    """32 bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(CHALLENGE_LEN)


def parse_challenge(text: str) -> bytes:
    """A client's nonce: exactly 64 hexadecimal digits. Raises ValueError saying what is wrong
    (never echoing the input)."""
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ValueError("the nonce must be hexadecimal") from None
    if len(value) != CHALLENGE_LEN:
        raise ValueError(f"the nonce must be {CHALLENGE_LEN} bytes (64 hex digits)")
    return value


def gpu_nonces(challenge: bytes, num_gpus: int) -> list[bytes]:
    """The SPDM nonce of GPU `i` (NVML's device order) for `challenge`:
    SHA-256("inferno.gpu-nonce.v1" ‖ 0x00 ‖ challenge ‖ i as 4 bytes big-endian)."""
    if len(challenge) != CHALLENGE_LEN:
        raise ValueError(f"a challenge is {CHALLENGE_LEN} bytes")
    return [
        hashlib.sha256(_GPU_NONCE_CONTEXT + challenge + index.to_bytes(4, "big")).digest()
        for index in range(num_gpus)
    ]
