"""TLS material: the demo's self-signed pair, the operator's pair checked before serving."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from appliance.errors import TlsError
from appliance.tls import (
    certificate_fingerprint,
    ensure_self_signed_certificate,
    verify_certificate_pair,
)


def _pair(directory: Path) -> tuple[Path, Path]:
    return directory / "tls" / "cert.pem", directory / "tls" / "key.pem"


def test_self_signed_pair_names_loopback_and_the_host_and_is_usable(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    assert ensure_self_signed_certificate(cert, key, ["inferno.internal", "10.0.0.7", "0.0.0.0"])
    certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "inferno.internal"}
    assert set(names.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("10.0.0.7"),
    }
    validity = certificate.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=364) < validity <= datetime.timedelta(days=365)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    verify_certificate_pair(cert, key)


def test_existing_pair_is_kept_so_pinned_clients_keep_trusting_it(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    fingerprint = certificate_fingerprint(cert)
    assert not ensure_self_signed_certificate(cert, key)
    assert certificate_fingerprint(cert) == fingerprint


def test_fingerprint_is_the_sha256_of_the_der_certificate(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    expected = ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert certificate_fingerprint(cert) == expected


def test_a_lone_certificate_or_key_is_refused_not_replaced(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    key.unlink()
    with pytest.raises(TlsError, match=r"cert\.pem exists but .*key\.pem does not"):
        ensure_self_signed_certificate(cert, key)


def test_key_of_another_certificate_is_refused_naming_both_settings(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    other_cert, other_key = _pair(tmp_path / "other")
    ensure_self_signed_certificate(cert, key)
    ensure_self_signed_certificate(other_cert, other_key)
    with pytest.raises(TlsError, match=r"cannot use tls\.cert_file = .* with tls\.key_file"):
        verify_certificate_pair(cert, other_key)


def test_unreadable_certificate_is_a_tls_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(TlsError, match="cannot read the certificate"):
        certificate_fingerprint(bad)
