"""Where an issuer's verification keys come from: a pinned JWK Set file, or the issuer's JWKS
fetched over TLS (found through its discovery document) and cached.

The fetched cache:
1. Keys are refreshed once they are `ttl_s` old.
2. A token naming a `kid` the cache lacks triggers one refetch (a rotated key is accepted
   within seconds), but fetches of one issuer are at least `refetch_interval_s` apart, so a
   flood of random kids, or an IdP that is down, costs one request per interval, not one per
   token.
3. Every good JWK Set is written to disk; at start the last one is read back, so a restart
   while the IdP is unreachable keeps working.
4. While refreshes fail, the last good keys are used until they are `max_staleness_s` old
   (counted from when they were fetched); after that every token of the issuer is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jwt

from appliance.auth.discovery import DiscoveryError, ProviderMetadata
from appliance.auth.errors import AuthConfigError, AuthenticationError, Reason
from appliance.auth.idp_http import IdpHttp, IdpUnreachableError
from appliance.auth.keyset import MAX_JWKS_BYTES, JwksFormatError, KeySet
from appliance.json_limits import parse_json

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """An issuer's keys as an admin sees them (the console's Access page): never key material."""

    pinned: bool
    key_ids: tuple[str, ...]
    # When the keys held were fetched: None for pinned keys, or before the first fetch.
    fetched_at: float | None
    # Fetched keys past the staleness limit: every token of the issuer is refused until a
    # fetch succeeds.
    stale: bool
    # Fetched keys: when the first token after it refreshes them (fetched_at + ttl_s), and
    # when they go stale unless a refresh succeeds (fetched_at + max_staleness_s).
    refresh_at: float | None = None
    stale_at: float | None = None
    # The last fetch tried; later than fetched_at when it failed (the IdP unreachable, or its
    # answer unusable).
    last_attempt_at: float | None = None


class KeySource(Protocol):
    async def key_for(self, kid: str, alg: str) -> jwt.PyJWK:
        """The key `kid` of this issuer, bound to `alg`; raises `AuthenticationError`."""
        ...

    def status(self) -> KeyStatus:
        """What this source holds now."""
        ...


@dataclass(frozen=True, slots=True)
class PinnedKeys:
    """A JWK Set from a file, fixed for the life of the process (air-gapped sites)."""

    key_set: KeySet

    @classmethod
    def load(cls, path: Path) -> PinnedKeys:
        try:
            return cls(KeySet.parse(path.read_bytes()))
        except OSError as exc:
            raise AuthConfigError(f"cannot read the pinned JWK Set {path}: {exc}") from exc
        except JwksFormatError as exc:
            raise AuthConfigError(f"the pinned JWK Set {path} is unusable: {exc}") from exc

    async def key_for(self, kid: str, alg: str) -> jwt.PyJWK:
        return self.key_set.key_for(kid, alg)

    def status(self) -> KeyStatus:
        return KeyStatus(True, tuple(sorted(self.key_set.keys)), None, stale=False)


@dataclass(frozen=True, slots=True)
class _Cached:
    key_set: KeySet
    fetched_at: float


@dataclass(frozen=True, slots=True)
class CachePolicy:
    ttl_s: float
    refetch_interval_s: float
    max_staleness_s: float


class FetchedKeys:
    """One issuer's JWKS, fetched through its discovery document and cached (module docstring)."""

    def __init__(
        self,
        issuer: str,
        discovery_url: str,
        http: IdpHttp,
        cache_file: Path,
        policy: CachePolicy,
        clock: Clock,
    ) -> None:
        self.issuer = issuer
        self.discovery_url = discovery_url
        self.cache_file = cache_file
        self.policy = policy
        self._http = http
        self._clock = clock
        self._cached: _Cached | None = None
        self._last_attempt: float | None = None
        self._lock = asyncio.Lock()

    def load_cached(self) -> None:
        """Read the last good JWK Set back from disk, if there is a usable one."""
        try:
            record = parse_json(
                self.cache_file.read_bytes(),
                what="the cached JWK Set",
                error=JwksFormatError,
                max_bytes=2 * MAX_JWKS_BYTES,
            )
            if not isinstance(record, dict) or record.get("issuer") != self.issuer:
                raise ValueError("the file is not this issuer's cached JWK Set")
            self._cached = _Cached(KeySet.parse(record["jwks"]), float(record["fetched_at"]))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the cached keys in %s: %s", self.cache_file, exc)

    async def key_for(self, kid: str, alg: str) -> jwt.PyJWK:
        now = self._clock()
        cached = self._cached
        if cached is None or kid not in cached.key_set or self._expired(cached, now):
            await self._refresh(kid)
            cached = self._cached
        if cached is None or now - cached.fetched_at > self.policy.max_staleness_s:
            raise AuthenticationError(Reason.KEYS_UNAVAILABLE)
        return cached.key_set.key_for(kid, alg)

    def status(self) -> KeyStatus:
        cached = self._cached
        if cached is None:
            return KeyStatus(False, (), None, stale=True, last_attempt_at=self._last_attempt)
        policy, fetched_at = self.policy, cached.fetched_at
        return KeyStatus(
            pinned=False,
            key_ids=tuple(sorted(cached.key_set.keys)),
            fetched_at=fetched_at,
            stale=self._clock() - fetched_at > policy.max_staleness_s,
            refresh_at=fetched_at + policy.ttl_s,
            stale_at=fetched_at + policy.max_staleness_s,
            last_attempt_at=self._last_attempt,
        )

    def _expired(self, cached: _Cached, now: float) -> bool:
        return now - cached.fetched_at >= self.policy.ttl_s

    async def _refresh(self, kid: str) -> None:
        """Fetch the JWKS unless another fetch is under way or was tried within the refetch
        interval (step 2). Failures keep the previous keys (step 4)."""
        async with self._lock:
            now = self._clock()
            cached = self._cached
            if cached is not None and kid in cached.key_set and not self._expired(cached, now):
                return  # a concurrent request just fetched it
            if (
                self._last_attempt is not None
                and now - self._last_attempt < self.policy.refetch_interval_s
            ):
                return
            self._last_attempt = now
            try:
                key_set = await self._fetch()
            except (IdpUnreachableError, DiscoveryError, JwksFormatError) as exc:
                logger.warning("cannot refresh the keys of issuer %s: %s", self.issuer, exc)
                return
            self._cached = _Cached(key_set, now)
            self._persist(self._cached)

    async def _fetch(self) -> KeySet:
        metadata = ProviderMetadata.parse(
            await self._http.get_json(self.discovery_url), self.issuer
        )
        return KeySet.parse(await self._http.get_json(metadata.jwks_uri))

    def _persist(self, cached: _Cached) -> None:
        record = {
            "issuer": self.issuer,
            "fetched_at": cached.fetched_at,
            "jwks": cached.key_set.to_json(),
        }
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.cache_file.parent, prefix=".jwks-")
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump(record, file)
            os.replace(temporary, self.cache_file)
        except OSError as exc:
            logger.error(
                "cannot keep issuer %s's keys in %s: %s", self.issuer, self.cache_file, exc
            )


def cache_file_for(cache_dir: Path, issuer: str) -> Path:
    """One file per issuer, named by a digest of the issuer (any characters may be in it)."""
    return cache_dir / f"jwks-{hashlib.sha256(issuer.encode()).hexdigest()[:32]}.json"
