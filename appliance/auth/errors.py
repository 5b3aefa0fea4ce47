"""Errors of access control: one root, a type per decision a caller maps to a response.

`AuthenticationError` (401) carries a fixed `reason` phrase that is safe to log and to audit; no
message ever quotes a token or a secret.
"""

from __future__ import annotations

from enum import StrEnum

from appliance.errors import ApplianceError


class AuthError(Exception):
    """Root of every error access control raises."""


class Reason(StrEnum):
    """Why a request was not authenticated: fixed phrases for logs, audit events and the
    `error_description` of the `WWW-Authenticate` challenge."""

    NO_TOKEN = "no bearer token"
    MALFORMED_REQUEST = "malformed Authorization header"
    MALFORMED_TOKEN = "malformed token"
    DISALLOWED_ALGORITHM = "algorithm not allowed"
    UNKNOWN_ISSUER = "unknown issuer"
    UNKNOWN_KEY = "unknown signing key"
    KEYS_UNAVAILABLE = "issuer keys unavailable"
    BAD_SIGNATURE = "bad signature"
    WRONG_TYPE = "not an access token"
    WRONG_AUDIENCE = "wrong audience"
    WRONG_ISSUER = "wrong issuer"
    EXPIRED = "expired"
    NOT_YET_VALID = "not yet valid"
    MISSING_CLAIM = "missing or malformed claim"
    NO_SESSION = "no console session"
    CSRF = "missing or wrong CSRF token"


class AuthenticationError(AuthError):
    """The request carries no usable credentials: answered 401 with a `Bearer` challenge.

    `claimed` holds what the token said about its issuer, subject and client when it could be
    read at all (unverified: for the audit log only, never for a decision)."""

    def __init__(self, reason: Reason, *, claimed: dict[str, str] | None = None) -> None:
        super().__init__(str(reason))
        self.reason = reason
        self.claimed = dict(claimed or {})


class AuthorizationError(AuthError):
    """An authenticated caller lacks the role a route needs (or holds roles that may not be
    combined): answered 403."""


class KeysUnavailableError(AuthError):
    """An issuer's signing keys could not be fetched and no cached copy is recent enough."""


class AuthConfigError(AuthError, ApplianceError):
    """Access-control material named in the settings is unusable (a pinned JWKS file, the local
    issuer's key); start-up stops with this message."""


class LoginError(AuthError):
    """A console login could not be completed (state mismatch, refused code exchange, an ID
    token that does not verify); the user is sent back to log in again."""
