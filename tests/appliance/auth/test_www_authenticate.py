"""The `WWW-Authenticate` challenges of RFC 6750 section 3."""

from __future__ import annotations

from appliance.auth.errors import AuthenticationError, AuthorizationError, Reason
from appliance.auth.www_authenticate import challenge


def test_request_without_credentials_gets_a_bare_challenge() -> None:
    assert challenge(AuthenticationError(Reason.NO_TOKEN)) == 'Bearer realm="inferno"'


def test_refused_token_gets_invalid_token_with_its_reason() -> None:
    assert challenge(AuthenticationError(Reason.EXPIRED)) == (
        'Bearer realm="inferno", error="invalid_token", error_description="expired"'
    )


def test_malformed_header_gets_invalid_request() -> None:
    value = challenge(AuthenticationError(Reason.MALFORMED_REQUEST))
    assert 'error="invalid_request"' in value


def test_missing_role_gets_insufficient_scope_with_only_safe_characters() -> None:
    value = challenge(AuthorizationError('needs "admin" \\ or\nauditor é'))
    assert value == (
        'Bearer realm="inferno", error="insufficient_scope", '
        'error_description="needs ?admin? ? or?auditor ?"'
    )
