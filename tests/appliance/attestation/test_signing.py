"""Signed verdicts: a client verifies the signature under the key the statement names; any
change to the statement, the key or the signature is refused."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest

from appliance.attestation.signing import (
    STATEMENT_TYPE,
    AttestationKey,
    SignedVerdictError,
    json_safe,
    verify_signed_verdict,
)


def _signed(key: AttestationKey) -> dict[str, Any]:
    return key.sign(
        {
            "type": STATEMENT_TYPE,
            "challenge": "ab" * 32,
            "attestation_public_key": key.public_bytes.hex(),
            "verdict": {"result": "trusted", "failed": []},
            "tee": "VERIFIED",
        }
    )


def test_a_signed_verdict_verifies_under_the_key_it_names() -> None:
    key = AttestationKey.generate()
    statement = verify_signed_verdict(_signed(key))
    assert statement["verdict"] == {"result": "trusted", "failed": []}
    assert len(key.public_bytes) == 32


def test_verify_rejects_a_statement_changed_after_signing() -> None:
    signed = _signed(AttestationKey.generate())
    signed["statement"]["verdict"]["result"] = "not trusted"
    with pytest.raises(SignedVerdictError, match="does not verify"):
        verify_signed_verdict(signed)


def test_verify_rejects_a_statement_that_names_another_key() -> None:
    signed = _signed(AttestationKey.generate())
    forged = copy.deepcopy(signed)
    forged["statement"]["attestation_public_key"] = AttestationKey.generate().public_bytes.hex()
    with pytest.raises(SignedVerdictError, match="does not verify"):
        verify_signed_verdict(forged)


def test_verify_rejects_a_flipped_signature_bit_and_garbage() -> None:
    signed = _signed(AttestationKey.generate())
    raw = bytearray(base64.b64decode(signed["signature"]))
    raw[0] ^= 1
    with pytest.raises(SignedVerdictError, match="does not verify"):
        verify_signed_verdict({**signed, "signature": base64.b64encode(raw).decode()})
    with pytest.raises(SignedVerdictError, match="malformed"):
        verify_signed_verdict({**signed, "signature": "not base64!"})
    with pytest.raises(SignedVerdictError, match="statement object"):
        verify_signed_verdict({"signature": signed["signature"]})


def test_a_key_signs_only_statements_that_name_it() -> None:
    key = AttestationKey.generate()
    with pytest.raises(ValueError, match="name the key"):
        key.sign({"type": STATEMENT_TYPE, "attestation_public_key": "00" * 32})


def test_integers_beyond_ijson_range_are_signed_as_strings() -> None:
    assert json_safe({"tcb": 2**64 - 1, "n": [1, True, None]}) == {
        "tcb": str(2**64 - 1),
        "n": [1, True, None],
    }
