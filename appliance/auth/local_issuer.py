"""The appliance's own token issuer, for the demo and break-glass: an Ed25519 key of its own,
its own JWK Set, short-lived RFC 9068 access tokens (`inferno token --role ROLE --sub NAME`).

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
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.auth.access_token import AccessTokenPolicy, AccessTokenVerifier
from appliance.auth.errors import AuthConfigError
from appliance.auth.key_cache import PinnedKeys
from appliance.auth.keyset import KeySet
from appliance.auth.roles import ClaimPath, Role, RoleMapping
from appliance.auth.settings import AuthSettings

LOCAL_ISSUER = "urn:inferno:local-issuer"
LOCAL_AUDIENCE = "urn:inferno:api"
LOCAL_CLIENT_ID = "inferno-token"


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
        """A bearer access token for `subject` with one role, valid for `token_ttl_s`."""
        issued = int(now)
        claims = {
            "iss": LOCAL_ISSUER,
            "aud": LOCAL_AUDIENCE,
            "sub": subject,
            "client_id": LOCAL_CLIENT_ID,
            "roles": [role.value],
            "iat": issued,
            "nbf": issued,
            "exp": issued + self.token_ttl_s,
            "jti": secrets.token_urlsafe(16),
        }
        headers = {"kid": self.kid, "typ": "at+jwt"}
        return jwt.encode(claims, self._key, algorithm="EdDSA", headers=headers)

    def verifier(self, leeway_s: int) -> AccessTokenVerifier:
        policy = AccessTokenPolicy(
            issuer=LOCAL_ISSUER,
            audience=LOCAL_AUDIENCE,
            algorithms=frozenset({"EdDSA"}),
            require_access_token_type=True,
            leeway_s=leeway_s,
            role_mapping=RoleMapping(
                (ClaimPath(("roles",)),), {role: frozenset({role.value}) for role in Role}
            ),
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
