"""The `[auth]` settings: the identity providers whose tokens are accepted, how their claims
map to roles, key caching, console sessions and the local demo issuer. Part of
`appliance.config.Settings`; documented in docs/CONFIG.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.auth.keyset import ASYMMETRIC_ALGORITHMS
from appliance.auth.roles import ClaimPath, Role, RoleMapping, check_separation

LocalIssuerMode = Literal["off", "demo", "break-glass"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleValues(_Frozen):
    """The claim values that grant each role (any one of them suffices)."""

    user: tuple[str, ...] = ()
    service: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    auditor: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_separation({Role.ADMIN: self.admin, Role.AUDITOR: self.auditor})
        if not any((self.user, self.service, self.admin, self.auditor)):
            raise ValueError("no claim value grants any role: map at least one")
        return self


def _https_url(value: str, what: str) -> str:
    parts = urlsplit(value)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"{what} must be an https:// URL (the IdP is reached over TLS only)")
    return value


class IssuerSettings(_Frozen):
    """One identity provider (one `[[auth.issuers]]` table)."""

    issuer: str = Field(min_length=1, description="the tokens' exact `iss`")
    audience: str = Field(min_length=1, description="the `aud` a token must name")
    discovery_url: str | None = Field(
        default=None,
        description="OpenID discovery document; default <issuer>/.well-known/openid-configuration",
    )
    jwks_file: Path | None = Field(
        default=None, description="pinned JWK Set (air-gapped sites): no discovery, no fetches"
    )
    algorithms: tuple[str, ...] = Field(default=("RS256", "PS256", "ES256", "EdDSA"), min_length=1)
    require_access_token_type: bool = Field(
        default=False, description="require the RFC 9068 header `typ: at+jwt`"
    )
    role_claims: tuple[str, ...] = Field(min_length=1)
    roles: RoleValues
    console_client_id: str | None = Field(default=None, min_length=1)
    console_client_secret_file: Path | None = None
    console_redirect_uri: str | None = None
    console_post_logout_redirect_uri: str | None = None

    @field_validator("algorithms")
    @classmethod
    def _check_algorithms(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for alg in value:
            if alg not in ASYMMETRIC_ALGORITHMS:
                raise ValueError(
                    f"{alg!r} is not allowed: only asymmetric JWS algorithms "
                    f"({', '.join(ASYMMETRIC_ALGORITHMS)}); never `none`, never HMAC (HS256 ...)"
                )
        return value

    @field_validator("role_claims")
    @classmethod
    def _check_role_claims(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for text in value:
            ClaimPath.parse(text)
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.jwks_file is not None:
            if self.discovery_url is not None:
                raise ValueError("give discovery_url or jwks_file, not both")
            if self.console_client_id is not None:
                raise ValueError("console login needs discovery: remove jwks_file or console_*")
        else:
            _https_url(self.discovery_document_url, "discovery_url (or the issuer)")
        console = (
            self.console_client_id,
            self.console_redirect_uri,
            self.console_client_secret_file,
        )
        if any(console) and not all(console):
            raise ValueError(
                "console login needs console_client_id, console_redirect_uri and "
                "console_client_secret_file"
            )
        if self.console_redirect_uri is not None:
            _https_url(self.console_redirect_uri, "console_redirect_uri")
        return self

    @property
    def discovery_document_url(self) -> str:
        return self.discovery_url or self.issuer.rstrip("/") + "/.well-known/openid-configuration"

    def role_mapping(self) -> RoleMapping:
        values = {role: frozenset(getattr(self.roles, role.value)) for role in Role}
        return RoleMapping(tuple(ClaimPath.parse(c) for c in self.role_claims), values)


class AuthSettings(_Frozen):
    issuers: tuple[IssuerSettings, ...] = Field(
        default=(), description="the identity providers whose access tokens are accepted"
    )
    ca_file: Path | None = Field(
        default=None, description="CA bundle (PEM) trusted for the IdPs' TLS; default: the system's"
    )
    leeway_s: int = Field(default=60, ge=0, le=300, description="clock skew for exp/nbf/iat")
    jwks_cache_dir: Path | None = Field(
        default=None, description="where the last good JWK Set of each IdP is kept"
    )
    jwks_cache_ttl_s: float = Field(default=300.0, gt=0, description="refresh keys this often")
    jwks_refetch_interval_s: float = Field(
        default=10.0, gt=0, description="at most one fetch per issuer this often (unknown kid)"
    )
    jwks_max_staleness_s: float = Field(
        default=43200.0, gt=0, description="IdP unreachable: use cached keys this long, then deny"
    )
    fetch_timeout_s: float = Field(default=5.0, gt=0, description="IdP request timeout")
    failure_events_per_minute: int = Field(
        default=30, ge=1, description="audited authentication failures per client address"
    )
    session_idle_timeout_s: int = Field(default=900, ge=60, description="console session idle")
    session_absolute_timeout_s: int = Field(
        default=28800, ge=60, description="console session lifetime"
    )
    local_issuer: LocalIssuerMode = Field(default="off", description="the local demo issuer")
    local_issuer_key_file: Path | None = Field(
        default=None, description="its Ed25519 key (made at first use)"
    )
    local_issuer_token_ttl_s: int = Field(default=3600, ge=60, le=86400)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.issuers and self.local_issuer == "off":
            raise ValueError(
                "no issuer is configured, so no request could be authorized: add "
                '[[auth.issuers]], or set local_issuer = "demo" for a demo'
            )
        if self.issuers and self.local_issuer == "demo":
            raise ValueError(
                'local_issuer = "demo" is refused where identity providers are configured (a '
                'production config); set local_issuer = "break-glass" to accept its tokens '
                "there explicitly, or remove it"
            )
        if self.local_issuer != "off" and self.local_issuer_key_file is None:
            raise ValueError("the local issuer needs local_issuer_key_file")
        if any(i.jwks_file is None for i in self.issuers) and self.jwks_cache_dir is None:
            raise ValueError(
                "jwks_cache_dir is required with discovery: the last good keys are kept there "
                "for when the identity provider cannot be reached"
            )
        if sum(i.console_client_id is not None for i in self.issuers) > 1:
            raise ValueError("console login can be configured for one issuer only")
        if len({i.issuer for i in self.issuers}) != len(self.issuers):
            raise ValueError("an issuer is configured twice")
        if self.session_idle_timeout_s > self.session_absolute_timeout_s:
            raise ValueError("session_idle_timeout_s is longer than session_absolute_timeout_s")
        return self
