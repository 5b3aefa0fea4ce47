"""The network edge of the client verifier: one `GET /v1/attestation` over an httpx transport,
with the SHA-256 of the SubjectPublicKeyInfo that the very connection carrying the answer
presented (read from httpcore's `network_stream` before the body is read), and the answer
read within MAX_ATTESTATION_RESPONSE_BYTES."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from attestation.binding import NONCE_SIZE
from attestation.errors import EvidenceError
from attestation.remote.document import MAX_ATTESTATION_RESPONSE_BYTES, AttestationDocument
from attestation.remote.errors import ApplianceAttestationError, ChannelMismatchError

ATTESTATION_PATH = "/v1/attestation"


@dataclass(frozen=True, slots=True)
class AttestationAnswer:
    """What one attestation request saw: the peer's SPKI hash, and the parsed answer (None when
    the appliance attests nothing: tee.mode = insecure-dev answers 409 `tee_unverified`)."""

    peer_spki_sha256: bytes
    document: AttestationDocument | None


def new_nonce() -> bytes:
    """32 bytes from the operating system's CSPRNG, for one attestation only."""
    return secrets.token_bytes(NONCE_SIZE)


def spki_sha256(certificate_der: bytes) -> bytes:
    """SHA-256 of the DER SubjectPublicKeyInfo of a DER certificate (what report_data v2
    binds: attestation.binding.Channel)."""
    public_key = x509.load_der_x509_certificate(certificate_der).public_key()
    return hashlib.sha256(
        public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    ).digest()


def stream_peer_spki_sha256(network_stream: Any) -> bytes:
    """The SPKI hash of the peer of an httpcore network stream. Raises ChannelMismatchError if
    the stream is not TLS or shows no certificate."""
    ssl_object = None if network_stream is None else network_stream.get_extra_info("ssl_object")
    # httpcore gives an ssl.SSLObject (TLS in TLS, through a proxy) or the SSLSocket's own
    # _ssl._SSLSocket: both answer getpeercert(True) with the DER certificate.
    if ssl_object is None or not hasattr(ssl_object, "getpeercert"):
        raise ChannelMismatchError("the connection is not TLS: nothing can be bound to it")
    certificate = ssl_object.getpeercert(True)
    if not certificate:
        raise ChannelMismatchError("the TLS peer presented no certificate")
    return spki_sha256(certificate)


def response_peer_spki_sha256(response: httpx.Response) -> bytes:
    """The SPKI hash of the peer of the connection `response` arrived on."""
    return stream_peer_spki_sha256(response.extensions.get("network_stream"))


def fetch_attestation(
    transport: httpx.BaseTransport, origin: httpx.URL, nonce: bytes, *, timeout_s: float = 60.0
) -> AttestationAnswer:
    """`GET /v1/attestation?nonce=` at `origin` through `transport`. Raises
    ApplianceAttestationError for an answer other than 200 or 409 `tee_unverified`,
    EvidenceError for one over the limit or malformed, httpx.HTTPError for the network."""
    response = transport.handle_request(_attestation_request(origin, nonce, timeout_s))
    try:
        peer = response_peer_spki_sha256(response)
        body = _read_bounded(response.stream)  # type: ignore[arg-type]
    finally:
        response.close()
    return _answer(response.status_code, body, peer)


async def afetch_attestation(
    transport: httpx.AsyncBaseTransport,
    origin: httpx.URL,
    nonce: bytes,
    *,
    timeout_s: float = 60.0,
) -> AttestationAnswer:
    """fetch_attestation through an asynchronous transport."""
    response = await transport.handle_async_request(_attestation_request(origin, nonce, timeout_s))
    try:
        peer = response_peer_spki_sha256(response)
        body = await _aread_bounded(response.stream)  # type: ignore[arg-type]
    finally:
        await response.aclose()
    return _answer(response.status_code, body, peer)


def _attestation_request(origin: httpx.URL, nonce: bytes, timeout_s: float) -> httpx.Request:
    url = origin.copy_with(path=ATTESTATION_PATH, query=f"nonce={nonce.hex()}".encode())
    return httpx.Request("GET", url, extensions={"timeout": httpx.Timeout(timeout_s).as_dict()})


def _answer(status: int, body: bytes, peer: bytes) -> AttestationAnswer:
    if status == 409 and b"tee_unverified" in body:
        return AttestationAnswer(peer, None)
    if status != 200:
        raise ApplianceAttestationError(f"{ATTESTATION_PATH} answered {status}: {body[:200]!r}")
    return AttestationAnswer(peer, AttestationDocument.parse(body))


def _too_large() -> EvidenceError:
    return EvidenceError(
        f"the /v1/attestation answer is larger than {MAX_ATTESTATION_RESPONSE_BYTES} bytes"
    )


def _read_bounded(stream: Iterable[bytes]) -> bytes:
    chunks, num_bytes = [], 0
    for chunk in stream:
        num_bytes += len(chunk)
        if num_bytes > MAX_ATTESTATION_RESPONSE_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def _aread_bounded(stream: AsyncIterable[bytes]) -> bytes:
    chunks, num_bytes = [], 0
    async for chunk in stream:
        num_bytes += len(chunk)
        if num_bytes > MAX_ATTESTATION_RESPONSE_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)
