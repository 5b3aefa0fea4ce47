"""An httpx transport that talks only to an attested appliance, for the `openai` client:

    transport = AttestedTransport(AppliancePolicy.from_file(p), ApplianceTrust.load(d),
                                  verify=ssl_context)
    client = openai.OpenAI(base_url="https://HOST:PORT/v1", api_key=token,
                           http_client=httpx.Client(transport=transport))

What it guarantees, per request:
 1. The first request, and the first after `reattest_after_s`, is preceded by an attestation
    with a fresh nonce on a fresh connection pool, verified by this client
    (attestation.remote.verify); anything short of a trusted verdict raises
    ApplianceNotTrustedError and no request is sent, body or headers.
 2. The verified evidence binds the SPKI of the connection that carried it; that SPKI is pinned.
 3. Every later TLS connection is checked as its handshake completes (httpcore's `trace`
    extension, `connection.start_tls.complete`), before the request is written to it: a peer
    with another key (a relay, a DNS or load-balancer re-route after the attestation) raises
    ChannelMismatchError and the connection is closed unused. Plain http:// and other origins
    are refused before anything is sent.
 4. With the policy's `max_verdict_age_s`, a response whose `X-Inferno-Attestation` names no
    standing verdict, or one older than that, raises StaleVerdictError (the response is closed;
    the request was sent, over an attested channel).

The errors (attestation.remote.errors) are not httpx's: the `openai` client passes them to the
caller as they are, without retrying. `AsyncAttestedTransport` (async_transport.py) gives the
same guarantees to httpx.AsyncClient (openai.AsyncOpenAI).
"""

from __future__ import annotations

import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from attestation.errors import EvidenceError
from attestation.remote.connection import (
    AttestationAnswer,
    fetch_attestation,
    new_nonce,
    response_peer_spki_sha256,
    stream_peer_spki_sha256,
)
from attestation.remote.errors import (
    ApplianceAttestationError,
    ApplianceNotTrustedError,
    ChannelMismatchError,
    StaleVerdictError,
)
from attestation.remote.policy import AppliancePolicy
from attestation.remote.trust import ApplianceTrust
from attestation.remote.verify import verify_appliance
from attestation.verdict import Check, Verdict

ATTESTATION_HEADER = "x-inferno-attestation"
_HEADER = re.compile(r"id=([0-9a-f]{32}); age=([0-9]{1,12})")


@dataclass(frozen=True, slots=True)
class AttestedPool:
    """One passing attestation: the pool it was made on (an httpx.HTTPTransport, or an
    httpx.AsyncHTTPTransport for the async transport), the pinned SPKI, when (monotonic)."""

    inner: Any
    spki_sha256: bytes
    verdict: Verdict
    at_s: float


class AttestingTransport:
    """What the sync and async transports share: their settings, the attestation in force, the
    pools it replaced, and when a new one is due. Each names its lock type (`_new_lock`)."""

    _new_lock: Callable[[], Any]

    def __init__(
        self,
        policy: AppliancePolicy,
        trust: ApplianceTrust,
        *,
        verify: ssl.SSLContext | bool = True,
        reattest_after_s: float = 300.0,
        timeout_s: float = 60.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if reattest_after_s <= 0:
            raise ValueError("reattest_after_s must be positive")
        self.policy = policy
        self.trust = trust
        self.verify = verify
        self.reattest_after_s = reattest_after_s
        self.timeout_s = timeout_s
        self.monotonic = monotonic
        self.num_attestations = 0
        self._origin: Origin | None = None
        self._attested: AttestedPool | None = None
        self._verdict: Verdict | None = None
        self._retired: list[Any] = []  # pools replaced, still serving requests begun on them
        self._lock = self._new_lock()

    @property
    def verdict(self) -> Verdict | None:
        """The verdict of the last passing attestation (None before the first)."""
        return self._verdict

    def _due(self, attested: AttestedPool | None) -> bool:
        """Whether a new attestation is needed: none yet, or the one in force is too old."""
        return attested is None or self.monotonic() - attested.at_s > self.reattest_after_s


class AttestedTransport(AttestingTransport, httpx.BaseTransport):
    """`verify` is httpx's: an SSLContext trusting the appliance's CA, True for the system's,
    or False to authenticate the appliance's key by the attestation alone (its per-boot
    self-signed key): the evidence must bind the key the connection presented, and every later
    connection must present it too, whatever `verify` says."""

    _new_lock = staticmethod(threading.Lock)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        attested = self._attested_for(request.url)
        request.extensions = {
            **request.extensions,
            "trace": pinning_trace(attested.spki_sha256, request.extensions.get("trace")),
        }
        response = attested.inner.handle_request(request)
        try:
            check_response(response, attested.spki_sha256, self.policy)
        except ApplianceAttestationError:
            response.close()
            raise
        return response

    def close(self) -> None:
        with self._lock:
            for inner in self._retired:
                inner.close()
            self._retired.clear()
            if self._attested is not None:
                self._attested.inner.close()
                self._attested = None

    def _attested_for(self, url: httpx.URL) -> AttestedPool:
        """The attestation in force for `url`'s origin, made now if there is none or it is older
        than reattest_after_s. Raises ApplianceAttestationError."""
        with self._lock:
            self._origin = check_origin(self._origin, url)
            attested = self._attested
            if self._due(attested):
                attested = self._attest(url)
                if self._attested is not None:
                    self._retire(self._attested.inner)
                self._attested, self._verdict = attested, attested.verdict
            return attested

    def _attest(self, url: httpx.URL) -> AttestedPool:
        inner = httpx.HTTPTransport(verify=self.verify)  # a fresh pool: no unchecked connection
        try:
            nonce = new_nonce()
            self.num_attestations += 1
            try:
                answer = fetch_attestation(inner, origin_of(url), nonce, timeout_s=self.timeout_s)
            except EvidenceError as exc:
                raise unusable(exc) from exc
            verdict = verdict_of(answer, nonce, self.policy, self.trust)
        except BaseException:
            inner.close()
            raise
        return AttestedPool(inner, answer.peer_spki_sha256, verdict, self.monotonic())

    def _retire(self, inner: httpx.HTTPTransport) -> None:
        """Keep the replaced pool open for the requests still using it, and close the one it
        replaced before that (requests do not outlast two attestation intervals)."""
        for old in self._retired:
            old.close()
        self._retired = [inner]


Origin = tuple[str, str, int | None]


def check_origin(attested: Origin | None, url: httpx.URL) -> Origin:
    """The origin a transport attests: `url`'s, which must be https:// and, once a transport
    attested one, that one. Raises ApplianceAttestationError."""
    if url.scheme != "https":
        raise ApplianceAttestationError(f"refusing {url.scheme}://: only TLS can be attested")
    origin = (url.scheme, url.host, url.port)
    if attested is not None and origin != attested:
        raise ApplianceAttestationError(
            f"this transport attests {attested[1]}:{attested[2]} only, not {url.host}:{url.port}"
        )
    return origin


def origin_of(url: httpx.URL) -> httpx.URL:
    return url.copy_with(path="/", query=None)


def unusable(exc: EvidenceError) -> ApplianceAttestationError:
    """An attestation answer that cannot be parsed, as what a transport's caller catches."""
    return ApplianceAttestationError(f"the appliance's attestation answer is unusable: {exc}")


def verdict_of(
    answer: AttestationAnswer, nonce: bytes, policy: AppliancePolicy, trust: ApplianceTrust
) -> Verdict:
    """The client's verdict on one attestation answer, at the current time. Raises
    ApplianceNotTrustedError unless it is trusted (an unparsable report included)."""
    at = datetime.now(UTC)
    if answer.document is None:
        detail = "the appliance says UNVERIFIED (tee.mode = insecure-dev): not attested"
        verdict = Verdict((Check("appliance.tee", False, detail),), at)
    else:
        try:
            verdict = verify_appliance(
                answer.document,
                nonce=nonce,
                peer_spki_sha256=answer.peer_spki_sha256,
                policy=policy,
                trust=trust,
                at=at,
            )
        except EvidenceError as exc:
            verdict = Verdict((Check("appliance.evidence", False, str(exc)),), at)
    if not verdict.trusted:
        raise ApplianceNotTrustedError(verdict)
    return verdict


def check_response(response: httpx.Response, pinned: bytes, policy: AppliancePolicy) -> None:
    """Guarantee 4 and a last look at 3: the response came over a connection to the pinned key,
    and (with max_verdict_age_s) names a standing verdict that fresh. Raises
    ApplianceAttestationError; the caller closes the response."""
    if response_peer_spki_sha256(response) != pinned:
        raise ChannelMismatchError("the response came from a peer with another TLS key")
    if policy.max_verdict_age_s is not None:
        header = response.headers.get(ATTESTATION_HEADER, "")
        check_standing_age(header, policy.max_verdict_age_s)


def check_standing_age(header: str, max_age_s: int) -> None:
    """Raise StaleVerdictError unless `header` (a response's X-Inferno-Attestation) names a
    standing verdict at most `max_age_s` old: `id=<32 hex>; age=<s>`, not PENDING or
    UNVERIFIED."""
    match = _HEADER.fullmatch(header)
    if match is None:
        raise StaleVerdictError(f"{ATTESTATION_HEADER} names no standing verdict ({header[:40]!r})")
    if int(match.group(2)) > max_age_s:
        raise StaleVerdictError(
            f"the appliance's standing verdict {match.group(1)} is {match.group(2)} s old; "
            f"the policy allows {max_age_s} s (max_verdict_age_s)"
        )


def pinning_trace(
    pinned_spki_sha256: bytes, chained: Callable[[str, dict[str, Any]], None] | None
) -> Callable[[str, dict[str, Any]], None]:
    """An httpcore trace callback that checks each new TLS connection's peer as its handshake
    completes, before a byte of the request is written, and closes it if the key is not the
    attested one (raising ChannelMismatchError)."""

    def trace(event: str, info: dict[str, Any]) -> None:
        if (refused := connection_mismatch(pinned_spki_sha256, event, info)) is not None:
            info["return_value"].close()
            raise refused
        if chained is not None:
            chained(event, info)

    return trace


def async_pinning_trace(
    pinned_spki_sha256: bytes, chained: Callable[[str, dict[str, Any]], Awaitable[None]] | None
) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
    """pinning_trace for httpcore's asynchronous interface, which awaits its trace callbacks."""

    async def trace(event: str, info: dict[str, Any]) -> None:
        if (refused := connection_mismatch(pinned_spki_sha256, event, info)) is not None:
            await info["return_value"].aclose()
            raise refused
        if chained is not None:
            await chained(event, info)

    return trace


def connection_mismatch(
    pinned_spki_sha256: bytes, event: str, info: dict[str, Any]
) -> ChannelMismatchError | None:
    """For httpcore's `connection.start_tls.complete` event (`info["return_value"]`: the new
    TLS stream): the error to raise if its peer did not present the pinned key, else None."""
    if event != "connection.start_tls.complete":
        return None
    try:
        peer = stream_peer_spki_sha256(info.get("return_value"))
    except ChannelMismatchError:
        peer = b""
    if peer == pinned_spki_sha256:
        return None
    return ChannelMismatchError(
        "a new TLS connection's peer presented another key than the attested one "
        f"({peer.hex()[:16] or 'none'}… instead of {pinned_spki_sha256.hex()[:16]}…): "
        "nothing was sent on it"
    )
