"""An OpenID Provider's metadata (OpenID Connect Discovery 1.0, section 3; RFC 8414), checked
against the issuer the settings name."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


class DiscoveryError(ValueError):
    """The discovery document is unusable or names another issuer."""


@dataclass(frozen=True, slots=True)
class ProviderMetadata:
    issuer: str
    jwks_uri: str
    authorization_endpoint: str | None
    token_endpoint: str | None
    end_session_endpoint: str | None

    @classmethod
    def parse(cls, document: object, expected_issuer: str) -> ProviderMetadata:
        """Parse `document` for the issuer whose access tokens carry `iss = expected_issuer`.

        The document's `issuer` must equal it exactly, or its `access_token_issuer` must (AD FS
        signs access tokens under another name than its discovery `issuer`). Endpoints must be
        https URLs: keys and codes never travel in the clear."""
        if not isinstance(document, dict):
            raise DiscoveryError("the discovery document is not a JSON object")
        names = {document.get("issuer"), document.get("access_token_issuer")}
        if expected_issuer not in names:
            raise DiscoveryError(
                f"the discovery document is for issuer {document.get('issuer')!r}, not the "
                f"configured {expected_issuer!r} (the match is exact)"
            )
        jwks_uri = _endpoint(document, "jwks_uri")
        if jwks_uri is None:
            raise DiscoveryError("the discovery document has no jwks_uri")
        return cls(
            issuer=document["issuer"],
            jwks_uri=jwks_uri,
            authorization_endpoint=_endpoint(document, "authorization_endpoint"),
            token_endpoint=_endpoint(document, "token_endpoint"),
            end_session_endpoint=_endpoint(document, "end_session_endpoint"),
        )


def _endpoint(document: dict[str, object], name: str) -> str | None:
    value = document.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or urlsplit(value).scheme != "https":
        raise DiscoveryError(f"the discovery document's {name} is not an https URL")
    return value
