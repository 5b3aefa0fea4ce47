"""Prefix-cache isolation domains: who may reuse whose cached prompt prefixes.

A request that finds its prefix in the KV cache starts sooner, so the time to the first token
tells a caller whether someone sent the same prefix before. The engine shares cached blocks only
between requests with the same cache salt (appliance.engine.block_manager), and the salt is
derived here, on the server, from the caller's verified identity and the policy
`engine.prefix_cache_isolation`:

- `principal`: one domain per issuer and subject (the default);
- `role`: one domain per set of roles, across issuers (a shared system prompt is reused by
  every caller of the same roles);
- `issuer`: one domain per token issuer;
- `shared`: one domain for everyone (fastest, and the timing tells).

A request's own `cache_salt` (vLLM's field) only narrows its domain: the engine's salt is
SHA-256 over the domain's salt and the client's, so no client salt reaches another domain's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated

from fastapi import Depends, Request

from appliance.api.access import principal_of
from appliance.auth.principal import Principal
from appliance.engine.engine_settings import PrefixCacheIsolation

_CONTEXT = "inferno prefix-cache domain v1"


def domain_salt(isolation: PrefixCacheIsolation, principal: Principal) -> str:
    """The salt of `principal`'s domain under `isolation`. The parts are JSON-encoded as one
    list, so that no two domains' parts can run into each other."""
    match isolation:
        case "principal":
            parts = [principal.issuer, principal.subject]
        case "role":
            parts = sorted(role.value for role in principal.roles)
        case "issuer":
            parts = [principal.issuer]
        case "shared":
            parts = []
    return _hash([_CONTEXT, isolation, *parts])


def request_salt(domain: str, client_salt: str | None) -> str:
    """The engine's salt for one request of `domain`, narrowed by the client's own salt."""
    if client_salt is None:
        return domain
    return _hash([_CONTEXT, "narrowed", domain, client_salt])


def _hash(parts: list[str]) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


class CacheDomain:
    """The caller's domain; `salt` gives each of its requests' engine salt."""

    def __init__(self, salt: str):
        self._salt = salt

    def salt(self, client_salt: str | None) -> str:
        return request_salt(self._salt, client_salt)


async def _cache_domain(request: Request) -> CacheDomain:
    principal = principal_of(request)
    if principal is None:
        # Inference routes need a bearer token (appliance.api.access); without a caller there is
        # no domain to put the request in, and sharing would be the unsafe guess.
        raise RuntimeError("an inference route was reached without an authenticated caller")
    return CacheDomain(domain_salt(request.app.state.prefix_cache_isolation, principal))


PrefixCacheDomain = Annotated[CacheDomain, Depends(_cache_domain)]
"""The calling principal's prefix-cache domain under `engine.prefix_cache_isolation`."""
