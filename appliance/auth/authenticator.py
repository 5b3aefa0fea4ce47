"""From an `Authorization` header to a `Principal`: the bearer token is read (RFC 6750 section
2.1), its issuer chosen among the configured ones by exact match, and verified with that
issuer's keys and policy alone.

A token that verified is remembered for at most `VERIFIED_TOKEN_TTL_S` and never past its
`exp`, as API gateways do (Envoy's jwt_authn cache, Kong): a client sends the same token on
every request, and its signature check was the largest single cost of a small request. The
price: a key the IdP withdraws stops admitting tokens already seen within that time, not at
once. Refused tokens are never remembered; each refusal is checked and audited again.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jwt

from appliance.auth.access_token import MAX_TOKEN_CHARS, AccessTokenPolicy, AccessTokenVerifier
from appliance.auth.errors import AuthenticationError, Reason
from appliance.auth.idp_http import IdpHttp
from appliance.auth.key_cache import CachePolicy, Clock, FetchedKeys, PinnedKeys, cache_file_for
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.principal import Principal
from appliance.auth.settings import AuthSettings, IssuerSettings

logger = logging.getLogger(__name__)

# RFC 6750 section 2.1: b64token = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="
_BEARER = re.compile(r"Bearer +([A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)


VERIFIED_TOKEN_TTL_S = 60.0
MAX_VERIFIED_TOKENS = 10_000


class VerifiedTokens:
    """The principals of recently verified tokens, each until `ttl_s` after its verification or
    its `exp`, whichever is first; at most `max_entries`, the oldest forgotten first."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Clock) -> None:
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, token: str) -> Principal | None:
        entry = self._entries.get(token)
        if entry is None:
            return None
        valid_until, principal = entry
        if self.clock() >= valid_until:
            del self._entries[token]
            return None
        return principal

    def add(self, token: str, principal: Principal) -> None:
        valid_until = min(self.clock() + self.ttl_s, principal.expires_at)
        if len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[token] = (valid_until, principal)


class Authenticator:
    def __init__(self, verifiers: Mapping[str, AccessTokenVerifier], clock: Clock) -> None:
        self.verifiers = dict(verifiers)
        self.verified = VerifiedTokens(VERIFIED_TOKEN_TTL_S, MAX_VERIFIED_TOKENS, clock)

    async def authenticate(self, authorization: Sequence[str]) -> Principal:
        """The principal named by the request's `Authorization` header values. Raises
        `AuthenticationError` (401) or `AuthorizationError` (roles that may not be combined)."""
        token = bearer_token(authorization)
        if (principal := self.verified.get(token)) is not None:
            return principal
        principal = await self._verify(token)
        self.verified.add(token, principal)
        return principal

    async def _verify(self, token: str) -> Principal:
        try:
            header = jwt.get_unverified_header(token)
            claims = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise AuthenticationError(Reason.MALFORMED_TOKEN) from None
        claimed = _claimed(claims)
        issuer = claims.get("iss")
        verifier = self.verifiers.get(issuer) if isinstance(issuer, str) else None
        if verifier is None:
            raise AuthenticationError(Reason.UNKNOWN_ISSUER, claimed=claimed)
        try:
            return await verifier.verify(token, header)
        except AuthenticationError as exc:
            raise AuthenticationError(exc.reason, claimed=claimed) from None

    @classmethod
    def from_settings(
        cls, settings: AuthSettings, http: IdpHttp, local_issuer: LocalIssuer | None, clock: Clock
    ) -> Authenticator:
        """Verifiers for every configured issuer, and the local issuer if given. Reads pinned
        JWK Sets and cached keys (raises `AuthConfigError` for an unusable pinned file)."""
        verifiers = {}
        for issuer in settings.issuers:
            keys = _key_source(issuer, settings, http, clock)
            policy = AccessTokenPolicy(
                issuer=issuer.issuer,
                audience=issuer.audience,
                algorithms=frozenset(issuer.algorithms),
                require_access_token_type=issuer.require_access_token_type,
                leeway_s=settings.leeway_s,
                role_mapping=issuer.role_mapping(),
            )
            verifiers[issuer.issuer] = AccessTokenVerifier(policy, keys)
        if local_issuer is not None:
            verifiers[local_issuer.issuer] = local_issuer.verifier(settings.leeway_s)
        return cls(verifiers, clock)


def bearer_token(authorization: Sequence[str]) -> str:
    """The token of a single `Authorization: Bearer <token>` header."""
    if not authorization:
        raise AuthenticationError(Reason.NO_TOKEN)
    if len(authorization) > 1:
        raise AuthenticationError(Reason.MALFORMED_REQUEST)
    [value] = authorization
    if not value.lower().startswith("bearer "):
        raise AuthenticationError(Reason.NO_TOKEN)  # another scheme: no credentials of ours
    match = _BEARER.fullmatch(value.strip())
    if match is None:
        raise AuthenticationError(Reason.MALFORMED_REQUEST)
    token = match.group(1)
    if len(token) > MAX_TOKEN_CHARS or token.count(".") != 2:
        raise AuthenticationError(Reason.MALFORMED_TOKEN)  # too long, or not a JWS (a JWE?)
    return token


def _claimed(claims: Mapping[str, object]) -> dict[str, str]:
    """What an unverified token says about who it is, for the audit log only (bounded)."""
    names = {"issuer": "iss", "subject": "sub", "client": "client_id"}
    return {
        field: value[:256]
        for field, claim in names.items()
        if isinstance(value := claims.get(claim), str)
    }


def _key_source(
    issuer: IssuerSettings, settings: AuthSettings, http: IdpHttp, clock: Clock
) -> PinnedKeys | FetchedKeys:
    if issuer.jwks_file is not None:
        return PinnedKeys.load(issuer.jwks_file)
    assert settings.jwks_cache_dir is not None, "AuthSettings requires it with discovery"
    keys = FetchedKeys(
        issuer.issuer,
        issuer.discovery_document_url,
        http,
        cache_file_for(Path(settings.jwks_cache_dir), issuer.issuer),
        CachePolicy(
            settings.jwks_cache_ttl_s,
            settings.jwks_refetch_interval_s,
            settings.jwks_max_staleness_s,
        ),
        clock,
    )
    keys.load_cached()
    return keys
