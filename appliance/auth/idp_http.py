"""HTTPS requests to identity providers: TLS verified against the customer's CA bundle (or the
system's), no redirects followed, bounded time and size. The one place auth talks to the
network.

httpx is imported by the first request, not with the server: with it come its command line's
rich and pygments, 80 of the server's 580 ms of imports on the development machine (W5 in
docs/BENCHMARKS.md), and a start whose tokens come from the local issuer alone never talks to an
identity provider. The TLS context, which reads the CA bundle, is still made at start-up."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.auth.errors import AuthError
from appliance.json_limits import parse_json

if TYPE_CHECKING:
    import httpx

MAX_DOCUMENT_BYTES = 1 << 20


class IdpUnreachableError(AuthError):
    """An identity provider did not answer a request usably (network, TLS, status, JSON)."""


def idp_tls_context(ca_file: Path | None) -> ssl.SSLContext:
    """Verifies IdP certificates against `ca_file` (PEM bundle), or the system's roots."""
    return ssl.create_default_context(cafile=ca_file)


class IdpHttp:
    def __init__(self, tls: ssl.SSLContext, timeout_s: float) -> None:
        self.tls = tls
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None  # made by the first request

    async def get_json(self, url: str) -> object:
        """GET `url` and parse its JSON body, within MAX_DOCUMENT_BYTES and
        appliance.json_limits.MAX_NESTING_DEPTH. Raises `IdpUnreachableError` naming the URL."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                verify=self.tls, timeout=self.timeout_s, follow_redirects=False
            )
        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise IdpUnreachableError(f"GET {url} answered {response.status_code}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_DOCUMENT_BYTES:
                        raise IdpUnreachableError(f"GET {url}: the document is over 1 MiB")
        except httpx.HTTPError as exc:
            raise IdpUnreachableError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
        return parse_json(
            bytes(body), what=f"GET {url}", error=IdpUnreachableError, max_bytes=MAX_DOCUMENT_BYTES
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
