"""The `WWW-Authenticate: Bearer ...` challenge of a refused request (RFC 6750 section 3).

A request without credentials gets a bare challenge (section 3.1: no error code); a token that
fails gets `invalid_token`, a malformed header `invalid_request`, and a caller without the
route's role `insufficient_scope` (403).
"""

from __future__ import annotations

import re

from appliance.auth.errors import AuthenticationError, AuthorizationError, Reason

REALM = "inferno"
_UNSAFE = re.compile(r"[^\x20\x21\x23-\x5b\x5d-\x7e]")  # section 3: error_description's chars


def challenge(error: AuthenticationError | AuthorizationError) -> str:
    if isinstance(error, AuthorizationError):
        return _bearer("insufficient_scope", str(error))
    if error.reason in (Reason.NO_TOKEN, Reason.NO_SESSION):
        return _bearer(None, None)
    if error.reason is Reason.MALFORMED_REQUEST:
        return _bearer("invalid_request", str(error.reason))
    return _bearer("invalid_token", str(error.reason))


def _bearer(code: str | None, description: str | None) -> str:
    parts = [f'realm="{REALM}"']
    if code is not None:
        parts.append(f'error="{code}"')
    if description is not None:
        parts.append(f'error_description="{_UNSAFE.sub("?", description)}"')
    return "Bearer " + ", ".join(parts)
