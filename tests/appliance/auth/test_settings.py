"""The `[auth]` settings refuse what would weaken access control, with messages that say what
to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from appliance.auth.settings import AuthSettings

ISSUER = {
    "issuer": "https://idp.example.com/realms/corp",
    "audience": "inferno",
    "role_claims": ["realm_access.roles"],
    "roles": {"user": ["inferno-user"]},
}


def _settings(tmp_path: Path, issuer: dict[str, Any] | None = None, **auth: Any) -> AuthSettings:
    values: dict[str, Any] = {"issuers": [{**ISSUER, **(issuer or {})}], "jwks_cache_dir": tmp_path}
    return AuthSettings.model_validate({**values, **auth})


def test_defaults_discover_the_issuer_and_allow_only_asymmetric_algorithms(tmp_path: Path) -> None:
    [issuer] = _settings(tmp_path).issuers
    assert issuer.discovery_document_url == (
        "https://idp.example.com/realms/corp/.well-known/openid-configuration"
    )
    assert set(issuer.algorithms) == {"RS256", "PS256", "ES256", "EdDSA"}


@pytest.mark.parametrize(
    ("issuer", "auth", "message"),
    [
        ({"algorithms": ["HS256"]}, {}, "never HMAC"),
        ({"algorithms": ["none"]}, {}, "never `none`"),
        ({"roles": {}}, {}, "map at least one"),
        ({"roles": {"admin": ["x"], "auditor": ["x"]}}, {}, "both admin and auditor"),
        ({"role_claims": []}, {}, "role_claims"),
        ({"role_claims": ["a..b"]}, {}, "claim path"),
        ({"issuer": "http://idp.example.com"}, {}, "https:// URL"),
        ({"discovery_url": "http://idp/.well-known/openid-configuration"}, {}, "https:// URL"),
        ({"jwks_file": "k.json", "discovery_url": "https://idp/x"}, {}, "not both"),
        ({"console_client_id": "inferno"}, {}, "console_client_secret_file"),
        ({}, {"jwks_cache_dir": None}, "jwks_cache_dir is required"),
        ({}, {"local_issuer": "demo", "local_issuer_key_file": "k.pem"}, "production config"),
        ({}, {"session_idle_timeout_s": 7200, "session_absolute_timeout_s": 3600}, "idle"),
    ],
)
def test_weakening_or_incoherent_settings_are_refused(
    tmp_path: Path, issuer: dict[str, Any], auth: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        _settings(tmp_path, issuer, **auth)


def test_no_issuer_at_all_is_refused() -> None:
    with pytest.raises(ValidationError, match="no issuer is configured"):
        AuthSettings()


def test_local_issuer_alone_is_a_demo_and_beside_an_idp_needs_break_glass(tmp_path: Path) -> None:
    demo = AuthSettings(local_issuer="demo", local_issuer_key_file=tmp_path / "k.pem")
    assert demo.issuers == ()
    with pytest.raises(ValidationError, match="needs local_issuer_key_file"):
        AuthSettings(local_issuer="demo")
    settings = _settings(tmp_path, local_issuer="break-glass", local_issuer_key_file="k.pem")
    assert settings.local_issuer == "break-glass"
