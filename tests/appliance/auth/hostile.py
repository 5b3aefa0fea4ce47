"""Hostile bearer tokens, each named after the attack it tries, with the reason the
authenticator must give when it refuses it. Made from the real IdP's tokens and keys (the
tests generated the IdP's keys), a second IdP the appliance does not trust, and keys of an
attacker.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from appliance.auth.errors import Reason
from tests.appliance.auth.idp import OidcProvider, private_key
from tests.appliance.auth.realm import SERVICE_SECRET


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"


@dataclass(frozen=True)
class Material:
    """What the hostile tokens are made from."""

    idp: OidcProvider
    # A second IdP, not configured in the appliance.
    other_idp: OidcProvider
    # An ID token of `idp` for a client whose id is the appliance's audience.
    id_token: str
    # A loopback URL where nothing may connect (the test checks that nothing did).
    attacker_url: str
    # A genuine access token of `idp`, and its claims.
    good: str
    claims: dict[str, Any]
    attacker: ec.EllipticCurvePrivateKey

    @classmethod
    def make(
        cls, idp: OidcProvider, other_idp: OidcProvider, id_token: str, attacker_url: str
    ) -> Material:
        good = idp.client_credentials_token("svc-batch", SERVICE_SECRET)
        claims = jwt.decode(good, options={"verify_signature": False})
        attacker = ec.generate_private_key(ec.SECP256R1())
        return cls(idp, other_idp, id_token, attacker_url, good, claims, attacker)

    def signed(self, **changes: Any) -> str:
        """The genuine claims with `changes` (None removes a claim), signed with the IdP's key."""
        claims = {**self.claims, **changes}
        claims = {name: value for name, value in claims.items() if value is not None}
        key = self.idp.keys[0]
        headers = {"kid": key["kid"], "typ": "at+jwt"}
        return jwt.encode(claims, private_key(key), algorithm="ES256", headers=headers)

    def signed_with_header(self, **header: Any) -> str:
        key = self.idp.keys[0]
        headers = {"kid": key["kid"], "typ": "at+jwt", **header}
        return jwt.encode(self.claims, private_key(key), algorithm="ES256", headers=headers)

    def by_attacker(self, kid: str, **header: Any) -> str:
        headers = {"kid": kid, "typ": "at+jwt", **header}
        return jwt.encode(self.claims, self.attacker, algorithm="ES256", headers=headers)

    def attacker_jwk(self) -> dict[str, Any]:
        return json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.attacker.public_key()))


def _hs256_with_the_idp_public_key(m: Material) -> str:
    """The classic key-confusion attack: the IdP's public key (PEM) used as an HMAC secret."""
    public_pem = (
        private_key(m.idp.keys[0])
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    signing_input = _unsigned(
        {"alg": "HS256", "typ": "at+jwt", "kid": m.idp.keys[0]["kid"]}, m.claims
    )
    signature = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


def _tampered_payload(m: Material) -> str:
    head, _, signature = m.good.split(".")
    elevated = {**m.claims, "realm_access": {"roles": ["inferno-service", "admin"]}}
    return f"{head}.{_b64(json.dumps(elevated).encode())}.{signature}"


def _flipped_signature_bit(m: Material) -> str:
    head, payload, signature = m.good.split(".")
    raw = bytearray(base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)))
    raw[-1] ^= 1
    return f"{head}.{payload}.{_b64(bytes(raw))}"


def _configured_issuers_claims_signed_by_the_other_idp(m: Material) -> str:
    """Same claims, same kid as the configured IdP's key, but the second IdP's key."""
    key = private_key(m.other_idp.keys[0])
    headers = {"kid": m.idp.keys[0]["kid"], "typ": "at+jwt"}
    return jwt.encode(m.claims, key, algorithm="ES256", headers=headers)


_LATER = 3600  # seconds ahead: beyond any leeway

HOSTILE: dict[str, tuple[Callable[[Material], str], Reason]] = {
    "alg_none": (
        lambda m: _unsigned({"alg": "none", "typ": "at+jwt"}, m.claims) + ".",
        Reason.DISALLOWED_ALGORITHM,
    ),
    "hs256_signed_with_the_idp_public_key": (
        _hs256_with_the_idp_public_key, Reason.DISALLOWED_ALGORITHM,
    ),
    "wrong_audience": (lambda m: m.signed(aud="urn:another:service"), Reason.WRONG_AUDIENCE),
    "missing_audience": (lambda m: m.signed(aud=None), Reason.WRONG_AUDIENCE),
    "wrong_issuer_signed_by_the_idp": (
        lambda m: m.signed(iss="https://127.0.0.1:1"), Reason.UNKNOWN_ISSUER,
    ),
    "expired": (
        lambda m: m.signed(iat=_now() - 2 * _LATER, exp=_now() - _LATER), Reason.EXPIRED,
    ),
    "not_yet_valid": (lambda m: m.signed(nbf=_now() + _LATER), Reason.NOT_YET_VALID),
    "issued_in_the_future": (
        lambda m: m.signed(iat=_now() + _LATER, exp=_now() + 2 * _LATER), Reason.NOT_YET_VALID,
    ),
    "missing_exp": (lambda m: m.signed(exp=None), Reason.MISSING_CLAIM),
    "missing_sub": (lambda m: m.signed(sub=None), Reason.MISSING_CLAIM),
    "tampered_payload": (_tampered_payload, Reason.BAD_SIGNATURE),
    "tampered_signature": (_flipped_signature_bit, Reason.BAD_SIGNATURE),
    "unknown_kid": (lambda m: m.by_attacker("kid-nobody-published"), Reason.UNKNOWN_KEY),
    "jku_pointing_elsewhere": (
        lambda m: m.by_attacker("attacker-key", jku=m.attacker_url), Reason.UNKNOWN_KEY,
    ),
    "x5u_pointing_elsewhere": (
        lambda m: m.by_attacker("attacker-key", x5u=m.attacker_url), Reason.UNKNOWN_KEY,
    ),
    "jku_with_the_idp_kid": (
        lambda m: m.by_attacker(m.idp.keys[0]["kid"], jku=m.attacker_url), Reason.BAD_SIGNATURE,
    ),
    "embedded_jwk_with_the_idp_kid": (
        lambda m: m.by_attacker(m.idp.keys[0]["kid"], jwk=m.attacker_jwk()),
        Reason.BAD_SIGNATURE,
    ),
    "id_token_for_an_access_token": (lambda m: m.id_token, Reason.WRONG_TYPE),
    "token_of_a_second_unconfigured_issuer": (
        lambda m: m.other_idp.client_credentials_token("svc-batch", SERVICE_SECRET),
        Reason.UNKNOWN_ISSUER,
    ),
    "configured_issuers_claims_signed_by_the_other_idp": (
        _configured_issuers_claims_signed_by_the_other_idp, Reason.BAD_SIGNATURE,
    ),
    "unknown_critical_header": (
        lambda m: m.signed_with_header(crit=["exp"]), Reason.MALFORMED_TOKEN,
    ),
    "not_a_jws": (lambda m: "eyJhbGciOiJub25lIn0.e30", Reason.MALFORMED_TOKEN),
}  # fmt: skip


def _now() -> int:
    return int(time.time())
