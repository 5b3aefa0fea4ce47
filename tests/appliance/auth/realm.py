"""The test realm: the IdP's clients and users, the roles their claims carry, and the
`[auth]` settings that trust that IdP through its test CA."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from appliance.auth.settings import AuthSettings
from tests.appliance.auth.idp import AUDIENCE, IdpCa, OidcProvider, node_available, signing_key

CONSOLE_SECRET = "console-secret-for-tests-only-0123456789"
SERVICE_SECRET = "service-secret-for-tests-only-0123456789"

# Keycloak-style claims for the services, group and role claims for the users.
CLIENT_CLAIMS = {
    "svc-batch": {"realm_access": {"roles": ["inferno-service", "offline_access"]}},
    "svc-nothing": {"realm_access": {"roles": ["offline_access"]}},
    "svc-ops": {"resource_access": {AUDIENCE: {"roles": ["admin"]}}},
}
USER_CLAIMS = {
    "alice": {"groups": ["inferno-users"]},
    "bob": {"resource_access": {AUDIENCE: {"roles": ["admin"]}}},
    "carol": {"roles": ["Inferno.Auditor"]},
    # Granted both sides of the separation of duties by a misconfigured IdP.
    "mallory": {"groups": ["inferno-admins"], "roles": ["Inferno.Auditor"]},
}
USERS = {name: {"password": f"{name}-password", "claims": c} for name, c in USER_CLAIMS.items()}


def _clients(console_origin: str) -> list[dict[str, Any]]:
    services = [
        {"client_id": name, "client_secret": SERVICE_SECRET, "grant_types": ["client_credentials"],
         "redirect_uris": [], "response_types": []}
        for name in CLIENT_CLAIMS
    ]  # fmt: skip
    console = {
        "client_id": AUDIENCE,
        "client_secret": CONSOLE_SECRET,
        "grant_types": ["authorization_code"],
        "token_endpoint_auth_method": "client_secret_post",
        "response_types": ["code"],
        "redirect_uris": [f"{console_origin}/console/callback"],
        "post_logout_redirect_uris": [f"{console_origin}/console/"],
    }
    return [*services, console]


def start_idp(
    directory: Path, ca: IdpCa, console_origin: str = "https://127.0.0.1:8443"
) -> OidcProvider:
    """The IdP serving this realm; its console client redirects to `console_origin`."""
    if not node_available():
        message = "the test OpenID provider is not installed: run ./bootstrap test"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    idp = OidcProvider(
        directory, ca, [signing_key("key-1")], _clients(console_origin), CLIENT_CLAIMS, USERS
    )
    idp.start()
    return idp


def issuer_settings(idp: OidcProvider, **overrides: Any) -> dict[str, Any]:
    """One `[[auth.issuers]]` table for `idp`, mapping every role the users and clients hold."""
    return {
        "issuer": idp.issuer,
        "audience": AUDIENCE,
        "role_claims": [
            "realm_access.roles",
            f'resource_access."{AUDIENCE}".roles',
            "groups",
            "roles",
        ],
        "roles": {
            "user": ["inferno-users"],
            "service": ["inferno-service"],
            "admin": ["admin", "inferno-admins"],
            "auditor": ["Inferno.Auditor"],
        },
        **overrides,
    }


def auth_settings(
    idp: OidcProvider, ca: IdpCa, cache_dir: Path, *, issuer: dict[str, Any] | None = None,
    **overrides: Any,
) -> AuthSettings:  # fmt: skip
    return AuthSettings.model_validate(
        {
            "issuers": [issuer or issuer_settings(idp)],
            "ca_file": ca.cert_file,
            "jwks_cache_dir": cache_dir,
            **overrides,
        }
    )
