"""The appliance's own token issuer, for the demo and break-glass: an Ed25519 key of its own,
its own JWK Set, short-lived RFC 9068 access tokens (`inferno token --role ROLE --sub NAME`, the
console's Access page), and the console's one-time sign-in tickets (`console_ticket`).

A token is planned (`plan`: its id, subject, roles and lifetime), recorded in the audit log by
the caller (`IssuedToken.audit_target`, under `TOKEN_ISSUE`), and only then signed (`sign`):
the audit log names every token handed out, by id, never by value.

Off unless `auth.local_issuer` enables it; refused in a config with identity providers unless
that says "break-glass" (`appliance.auth.settings`). Its tokens are verified like any IdP's,
through the same verifier, with its key pinned.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.auth.access_token import AccessTokenPolicy, AccessTokenVerifier
from appliance.auth.errors import AuthConfigError, AuthError
from appliance.auth.key_cache import PinnedKeys
from appliance.auth.keyset import KeySet
from appliance.auth.roles import SEPARATED_ROLES, ClaimPath, Role, RoleMapping
from appliance.auth.settings import AuthSettings

LOCAL_ISSUER = "urn:inferno:local-issuer"
LOCAL_AUDIENCE = "urn:inferno:api"
LOCAL_CLIENT_ID = "inferno-token"
LOCAL_ROLE_MAPPING = RoleMapping(
    (ClaimPath(("roles",)),), {role: frozenset({role.value}) for role in Role}
)
"""The local issuer's tokens name their roles in `roles`, by the roles' own names."""
TOKEN_ISSUE = "token.issue"
"""The admin operation (`admin.token.issue`) recorded before a local token is signed."""
MIN_TOKEN_TTL_S = 60
MAX_SUBJECT_CHARS = 256


class TokenRequestError(AuthError):
    """A token the local issuer will not make (no role, roles kept apart, a lifetime out of
    bounds, an unusable subject); the message says which."""


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A local token about to be signed: what the audit log records of it (never the token)."""

    token_id: str
    subject: str
    roles: frozenset[Role]
    issued_at: int
    expires_at: int

    def audit_target(self) -> dict[str, Any]:
        return {
            "issuer": LOCAL_ISSUER,
            "subject": self.subject,
            "roles": sorted(self.roles),
            "token_id": self.token_id,
            "issued": datetime.fromtimestamp(self.issued_at, UTC).isoformat(),
            "expires": datetime.fromtimestamp(self.expires_at, UTC).isoformat(),
        }


class LocalIssuer:
    issuer = LOCAL_ISSUER

    def __init__(self, key: Ed25519PrivateKey, token_ttl_s: int) -> None:
        self._key = key
        self.token_ttl_s = token_ttl_s
        public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        x = base64.urlsafe_b64encode(public).rstrip(b"=").decode()
        # RFC 7638 thumbprint (members in lexicographic order) as the key id.
        members = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": x}, separators=(",", ":"))
        kid = base64.urlsafe_b64encode(hashlib.sha256(members.encode()).digest()).rstrip(b"=")
        self.kid = kid.decode()
        jwk = {
            "kty": "OKP",
            "crv": "Ed25519",
            "x": x,
            "kid": self.kid,
            "alg": "EdDSA",
            "use": "sig",
        }
        self.jwks = KeySet({self.kid: jwk})

    @classmethod
    def from_settings(cls, settings: AuthSettings) -> LocalIssuer | None:
        """The local issuer if `auth.local_issuer` enables it (its key made if need be)."""
        if settings.local_issuer == "off":
            return None
        assert settings.local_issuer_key_file is not None, "AuthSettings requires it"
        return cls.load_or_create(settings.local_issuer_key_file, settings.local_issuer_token_ttl_s)

    @classmethod
    def load_or_create(cls, key_file: Path, token_ttl_s: int) -> LocalIssuer:
        """The issuer whose key is in `key_file` (PEM, PKCS#8), making the key (mode 0600) if
        the file does not exist. Refuses a key file others may read."""
        try:
            key_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return cls(_read_key(key_file), token_ttl_s)
        except OSError as exc:
            raise AuthConfigError(f"cannot make the local issuer's key {key_file}: {exc}") from exc
        key = Ed25519PrivateKey.generate()
        with os.fdopen(fd, "wb") as file:
            file.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        return cls(key, token_ttl_s)

    def mint(self, role: Role, subject: str, now: float) -> str:
        """A bearer access token for `subject` with one role, valid for `token_ttl_s`, signed
        at once (tests, benchmarks: nothing audited)."""
        return self.sign(self.plan({role}, subject, now))

    def plan(
        self, roles: Collection[Role], subject: str, now: float, ttl_s: int | None = None
    ) -> IssuedToken:
        """The token to issue to `subject` with `roles`, valid `ttl_s` (at most, and by
        default, `token_ttl_s`). Raises `TokenRequestError`."""
        ttl_s = self.token_ttl_s if ttl_s is None else ttl_s
        if not MIN_TOKEN_TTL_S <= ttl_s <= self.token_ttl_s:
            raise TokenRequestError(
                f"a token lives {MIN_TOKEN_TTL_S} s to {self.token_ttl_s} s "
                "(auth.local_issuer_token_ttl_s)"
            )
        if not subject.strip() or len(subject) > MAX_SUBJECT_CHARS or not subject.isprintable():
            raise TokenRequestError(
                f"the subject must be 1 to {MAX_SUBJECT_CHARS} printable characters"
            )
        if not roles:
            raise TokenRequestError("a token must grant at least one role")
        if set(roles) >= SEPARATED_ROLES:
            raise TokenRequestError(
                "admin and auditor are kept apart (separation of duties): grant one of them"
            )
        issued = int(now)
        return IssuedToken(
            secrets.token_urlsafe(16), subject, frozenset(roles), issued, issued + ttl_s
        )

    def sign(self, token: IssuedToken) -> str:
        """The RFC 9068 access token `token` describes."""
        claims = {
            "iss": LOCAL_ISSUER,
            "aud": LOCAL_AUDIENCE,
            "sub": token.subject,
            "client_id": LOCAL_CLIENT_ID,
            "roles": sorted(token.roles),
            "iat": token.issued_at,
            "nbf": token.issued_at,
            "exp": token.expires_at,
            "jti": token.token_id,
        }
        return self.sign_jwt(claims, "at+jwt")

    def sign_jwt(self, claims: dict[str, Any], typ: str) -> str:
        """`claims` signed with this issuer's key, the header naming its key and `typ`."""
        return jwt.encode(
            claims, self._key, algorithm="EdDSA", headers={"kid": self.kid, "typ": typ}
        )

    def verifier(self, leeway_s: int) -> AccessTokenVerifier:
        policy = AccessTokenPolicy(
            issuer=LOCAL_ISSUER,
            audience=LOCAL_AUDIENCE,
            algorithms=frozenset({"EdDSA"}),
            require_access_token_type=True,
            leeway_s=leeway_s,
            role_mapping=LOCAL_ROLE_MAPPING,
        )
        return AccessTokenVerifier(policy, PinnedKeys(self.jwks))


def _read_key(key_file: Path) -> Ed25519PrivateKey:
    try:
        mode = key_file.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthConfigError(
                f"the local issuer's key {key_file} is readable by others (mode "
                f"{stat.S_IMODE(mode):o}); chmod 600 it"
            )
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise AuthConfigError(f"cannot read the local issuer's key {key_file}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise AuthConfigError(f"the local issuer's key {key_file} is not an Ed25519 key")
    return key
