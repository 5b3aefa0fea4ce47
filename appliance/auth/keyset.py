"""A JSON Web Key Set (RFC 7517) parsed once into the public verification keys it holds, and
the choice of the key that may verify a token.

Only public signature keys of asymmetric algorithms are kept: symmetric (`oct`) keys, keys
marked for encryption, and keys that carry private members are dropped. A key is chosen by the
token's `kid` alone, within one issuer's set; its type (and curve) must suit the token's `alg`,
and a key that names its own `alg` only verifies that algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt

from appliance.auth.errors import AuthenticationError, Reason
from appliance.json_limits import parse_json

# An issuer publishes a handful of keys, each a few KiB with its certificate chain.
MAX_JWKS_BYTES = 1 << 20

# alg -> (kty, crv): the asymmetric JWS algorithms (RFC 7518 section 3, RFC 8037). Never
# `none`, never HMAC: an issuer's published key must not be usable as a shared secret.
ASYMMETRIC_ALGORITHMS: Mapping[str, tuple[str, str | None]] = {
    "RS256": ("RSA", None),
    "RS384": ("RSA", None),
    "RS512": ("RSA", None),
    "PS256": ("RSA", None),
    "PS384": ("RSA", None),
    "PS512": ("RSA", None),
    "ES256": ("EC", "P-256"),
    "ES384": ("EC", "P-384"),
    "ES512": ("EC", "P-521"),
    "EdDSA": ("OKP", "Ed25519"),
}

_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


class JwksFormatError(ValueError):
    """The document is not a JWK Set with at least one usable public signature key."""


@dataclass(frozen=True, slots=True)
class KeySet:
    # kid -> the JWK's members (public only)
    keys: Mapping[str, Mapping[str, Any]]

    @classmethod
    def parse(cls, document: object) -> KeySet:
        """Parse a JWK Set (a JSON object, or its text, within MAX_JWKS_BYTES and
        appliance.json_limits.MAX_NESTING_DEPTH). Raises `JwksFormatError` when nothing usable
        is in it."""
        if isinstance(document, str | bytes):
            document = parse_json(
                document, what="the JWK Set", error=JwksFormatError, max_bytes=MAX_JWKS_BYTES
            )
        if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
            raise JwksFormatError('not a JWK Set: expected an object with a "keys" list')
        keys = {}
        for jwk in document["keys"]:
            if _usable(jwk):
                keys[jwk["kid"]] = dict(jwk)
        if not keys:
            raise JwksFormatError(
                "the JWK Set has no public signature key with a kid of an asymmetric type "
                "(RSA, EC or OKP)"
            )
        return cls(keys)

    def to_json(self) -> dict[str, Any]:
        return {"keys": [dict(jwk) for jwk in self.keys.values()]}

    def __contains__(self, kid: str) -> bool:
        return kid in self.keys

    def key_for(self, kid: str, alg: str) -> jwt.PyJWK:
        """The key with this `kid` bound to `alg`. Raises `AuthenticationError` when there is
        none, or when it does not suit `alg` (another key type or curve, or another `alg`
        than the key's own)."""
        jwk = self.keys.get(kid)
        if jwk is None:
            raise AuthenticationError(Reason.UNKNOWN_KEY)
        kty, crv = ASYMMETRIC_ALGORITHMS[alg]
        if jwk["kty"] != kty or (crv is not None and jwk.get("crv") != crv):
            raise AuthenticationError(Reason.DISALLOWED_ALGORITHM)
        if jwk.get("alg", alg) != alg:
            raise AuthenticationError(Reason.DISALLOWED_ALGORITHM)
        return jwt.PyJWK(dict(jwk), algorithm=alg)


def _usable(jwk: object) -> bool:
    if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str):
        return False
    if jwk.get("kty") not in ("RSA", "EC", "OKP") or _PRIVATE_MEMBERS & jwk.keys():
        return False
    if jwk.get("use", "sig") != "sig":
        return False
    ops = jwk.get("key_ops")
    if ops is not None and (not isinstance(ops, list) or "verify" not in ops):
        return False
    alg = jwk.get("alg")
    if alg is not None and alg not in ASYMMETRIC_ALGORITHMS:
        return False
    try:
        jwt.PyJWK(dict(jwk))  # the key material itself must load
    except jwt.PyJWTError:
        return False
    return True
