"""AttestedTransport for httpx.AsyncClient (the `openai` package's AsyncOpenAI), with the same
four guarantees (attestation.remote.transport): attest before the first request and after
`reattest_after_s`, pin the attested key, check each new TLS connection's peer as its handshake
completes, and with `max_verdict_age_s` each response's standing verdict. The evidence is
verified in a worker thread, so that the event loop keeps serving while RIM signatures and
certificate chains are checked."""

from __future__ import annotations

import asyncio

import httpx

from attestation.errors import EvidenceError
from attestation.remote.connection import afetch_attestation, new_nonce
from attestation.remote.errors import ApplianceAttestationError
from attestation.remote.transport import (
    AttestedPool,
    AttestingTransport,
    async_pinning_trace,
    check_origin,
    check_response,
    origin_of,
    unusable,
    verdict_of,
)


class AsyncAttestedTransport(AttestingTransport, httpx.AsyncBaseTransport):
    """As AttestedTransport; `verify` likewise (False: the attestation alone authenticates the
    appliance's key)."""

    _new_lock = staticmethod(asyncio.Lock)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        attested = await self._attested_for(request.url)
        request.extensions = {
            **request.extensions,
            "trace": async_pinning_trace(attested.spki_sha256, request.extensions.get("trace")),
        }
        response = await attested.inner.handle_async_request(request)
        try:
            check_response(response, attested.spki_sha256, self.policy)
        except ApplianceAttestationError:
            await response.aclose()
            raise
        return response

    async def aclose(self) -> None:
        async with self._lock:
            for inner in self._retired:
                await inner.aclose()
            self._retired.clear()
            if self._attested is not None:
                await self._attested.inner.aclose()
                self._attested = None

    async def _attested_for(self, url: httpx.URL) -> AttestedPool:
        async with self._lock:
            self._origin = check_origin(self._origin, url)
            attested = self._attested
            if self._due(attested):
                attested = await self._attest(url)
                if self._attested is not None:
                    for old in self._retired:
                        await old.aclose()
                    self._retired = [self._attested.inner]
                self._attested, self._verdict = attested, attested.verdict
            return attested

    async def _attest(self, url: httpx.URL) -> AttestedPool:
        inner = httpx.AsyncHTTPTransport(verify=self.verify)  # a fresh pool
        try:
            nonce = new_nonce()
            self.num_attestations += 1
            try:
                answer = await afetch_attestation(
                    inner, origin_of(url), nonce, timeout_s=self.timeout_s
                )
            except EvidenceError as exc:
                raise unusable(exc) from exc
            verdict = await asyncio.to_thread(verdict_of, answer, nonce, self.policy, self.trust)
        except BaseException:
            await inner.aclose()
            raise
        return AttestedPool(inner, answer.peer_spki_sha256, verdict, self.monotonic())
