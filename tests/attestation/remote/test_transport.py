"""The transport's two per-response and per-connection checks, without a network: the pinning
trace refuses (and closes) a new TLS connection whose peer presents another key before the
request is written, and the standing verdict's age is read strictly from its header. The whole
transport runs against a real server and a relay in tests/e2e/test_attested_channel.py."""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID

from attestation.remote.errors import ChannelMismatchError, StaleVerdictError
from attestation.remote.transport import check_standing_age, pinning_trace


def _certificate_der() -> tuple[bytes, bytes]:
    """A DER certificate and the SHA-256 of its SubjectPublicKeyInfo."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "peer")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    spki = key.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return certificate.public_bytes(Encoding.DER), hashlib.sha256(spki).digest()


class _Stream:
    """Stands for httpcore's TLS network stream."""

    def __init__(self, certificate_der: bytes | None) -> None:
        self.certificate_der = certificate_der
        self.closed = False

    def get_extra_info(self, name: str) -> Any:
        if name != "ssl_object" or self.certificate_der is None:
            return None
        return self

    def getpeercert(self, binary_form: bool) -> bytes | None:
        return self.certificate_der

    def close(self) -> None:
        self.closed = True


def test_the_trace_passes_a_connection_to_the_pinned_key_and_chains_the_callers() -> None:
    der, spki = _certificate_der()
    seen: list[str] = []
    trace = pinning_trace(spki, lambda event, info: seen.append(event))
    stream = _Stream(der)
    trace("connection.start_tls.complete", {"return_value": stream})
    trace("http11.send_request_headers.started", {})
    assert not stream.closed
    assert seen == ["connection.start_tls.complete", "http11.send_request_headers.started"]


@pytest.mark.parametrize("peer", ["another-key", "no-certificate", "not-tls"])
def test_the_trace_refuses_and_closes_a_connection_to_another_key(peer: str) -> None:
    _, pinned = _certificate_der()
    other, _ = _certificate_der()
    stream = {"another-key": _Stream(other), "no-certificate": _Stream(b""),
              "not-tls": _Stream(None)}[peer]  # fmt: skip
    trace = pinning_trace(pinned, None)
    with pytest.raises(ChannelMismatchError, match="nothing was sent on it"):
        trace("connection.start_tls.complete", {"return_value": stream})
    assert stream.closed


@pytest.mark.parametrize(
    ("header", "passes"),
    [
        ("id=" + "ab" * 16 + "; age=60", True),
        ("id=" + "ab" * 16 + "; age=61", False),
        ("PENDING", False),
        ("UNVERIFIED", False),
        ("", False),
        ("id=" + "ab" * 16 + "; age=-1", False),
        ("id=" + "AB" * 16 + "; age=1", False),
        ("id=" + "ab" * 16 + "; age=1; id=" + "cd" * 16 + "; age=0", False),
    ],
)
def test_the_standing_verdict_must_be_named_and_fresh(header: str, passes: bool) -> None:
    if passes:
        check_standing_age(header, 60)
    else:
        with pytest.raises(StaleVerdictError):
            check_standing_age(header, 60)
