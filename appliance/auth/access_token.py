"""Verification of one issuer's bearer access tokens: JWS-signed JWTs (RFC 7519, RFC 9068),
checked as RFC 8725 (JWT best current practices) asks.

The issuer is chosen before this runs, among the configured ones only, and its keys are the only
keys tried: a token never picks the keys that verify it. Header members that point at keys
(`jku`, `x5u`, `jwk`, `x5c`) are never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt

from appliance.auth.errors import AuthenticationError, Reason
from appliance.auth.key_cache import KeySource
from appliance.auth.principal import Principal
from appliance.auth.roles import RoleMapping

MAX_TOKEN_CHARS = 16384
_ACCESS_TOKEN_TYPES = frozenset({"at+jwt", "application/at+jwt"})  # RFC 9068 section 4
_CLIENT_CLAIMS = ("client_id", "azp", "appid")  # RFC 9068; Keycloak and Entra v2; Entra v1, AD FS


@dataclass(frozen=True, slots=True)
class AccessTokenPolicy:
    """What one issuer's tokens must satisfy."""

    issuer: str
    audience: str
    algorithms: frozenset[str]
    require_access_token_type: bool
    leeway_s: int
    role_mapping: RoleMapping


class AccessTokenVerifier:
    def __init__(self, policy: AccessTokenPolicy, keys: KeySource) -> None:
        self.policy = policy
        self.keys = keys

    async def verify(self, token: str, header: Mapping[str, Any]) -> Principal:
        """Verify `token` (whose unverified `header` the caller parsed) and return who it names.
        Raises `AuthenticationError` with the reason, or `AuthorizationError` when its roles may
        not be combined.

        1. Header: an allowed asymmetric `alg`, a `kid`; `typ` = at+jwt if required. (PyJWT
           already refused unknown `crit` extensions when the caller parsed the header.)
        2. Key: this issuer's key with that `kid`, of the type the `alg` needs.
        3. Signature, then claims: `iss` exactly this issuer, `aud` naming our audience, `exp`
           required; `exp`, `nbf` and `iat` within the leeway; `sub` a string.
        4. Roles from the verified claims.
        """
        policy = self.policy
        # Step 1.
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in policy.algorithms:
            raise AuthenticationError(Reason.DISALLOWED_ALGORITHM)
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise AuthenticationError(Reason.MALFORMED_TOKEN)
        if policy.require_access_token_type:
            typ = header.get("typ")
            if not isinstance(typ, str) or typ.lower() not in _ACCESS_TOKEN_TYPES:
                raise AuthenticationError(Reason.WRONG_TYPE)
        # Step 2.
        key = await self.keys.key_for(kid, alg)
        # Step 3.
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=policy.audience,
                issuer=policy.issuer,
                leeway=policy.leeway_s,
                options={"require": ["exp", "iss", "aud", "sub"], "strict_aud": False},
            )
        except jwt.PyJWTError as exc:
            raise AuthenticationError(_reason(exc)) from None
        subject = claims["sub"]
        clients = (claims[c] for c in _CLIENT_CLAIMS if isinstance(claims.get(c), str))
        client_id = next(clients, None)
        if not isinstance(subject, str) or not subject:
            raise AuthenticationError(Reason.MISSING_CLAIM)
        # Step 4.
        return Principal(
            issuer=policy.issuer,
            subject=subject,
            client_id=client_id,
            roles=policy.role_mapping.roles(claims),
            expires_at=float(claims["exp"]),
        )


def _reason(exc: jwt.PyJWTError) -> Reason:
    """The fixed reason for a PyJWT error (the most specific classes first)."""
    if isinstance(exc, jwt.InvalidSignatureError):
        return Reason.BAD_SIGNATURE
    if isinstance(exc, jwt.ExpiredSignatureError):
        return Reason.EXPIRED
    if isinstance(exc, jwt.ImmatureSignatureError):
        return Reason.NOT_YET_VALID
    if isinstance(exc, jwt.InvalidAudienceError):
        return Reason.WRONG_AUDIENCE
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return Reason.WRONG_AUDIENCE if exc.claim == "aud" else Reason.MISSING_CLAIM
    if isinstance(exc, jwt.InvalidIssuerError):
        return Reason.WRONG_ISSUER
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return Reason.DISALLOWED_ALGORITHM
    if isinstance(exc, jwt.InvalidIssuedAtError):
        return Reason.MISSING_CLAIM
    return Reason.MALFORMED_TOKEN
