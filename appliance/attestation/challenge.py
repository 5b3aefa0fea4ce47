"""Challenges and what is derived from them: one 32-byte challenge per attestation, from which
each GPU's SPDM nonce is derived (`attestation.binding.gpu_nonces`, where a client finds it
too), and to which the CPU report is bound (with the GPU evidence digest, the appliance's
attestation key and its channel) through `attestation.binding.report_data_v2`.
"""

from __future__ import annotations

import secrets

from attestation.binding import NONCE_SIZE, gpu_nonces

__all__ = ["CHALLENGE_LEN", "gpu_nonces", "new_challenge", "parse_challenge"]

CHALLENGE_LEN = NONCE_SIZE


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
