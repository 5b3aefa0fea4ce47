"""TLS material: the demo's self-signed pair (its key written 0600), the operator's pair checked
before serving (its key refused, like every secret file, when others may read it)."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance.errors import TlsError
from appliance.tls import (
    certificate_fingerprint,
    certificate_spki_sha256,
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


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_key_readable_by_group_or_others_is_refused_like_every_other_secret_file(
    tmp_path: Path, mode: int
) -> None:
    """Issue 13, defect 4: the TLS key is checked as audit.keyfile checks every secret file."""
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    key.chmod(mode)
    with pytest.raises(TlsError, match=rf"tls\.key_file: .* has mode {mode:04o}.*chmod 600"):
        verify_certificate_pair(cert, key)


def test_key_behind_a_symlink_is_refused(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    link = tmp_path / "link.pem"
    link.symlink_to(key)
    with pytest.raises(TlsError, match=r"tls\.key_file: cannot open secret file"):
        verify_certificate_pair(cert, link)


def test_missing_key_is_a_tls_error_naming_the_setting(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    key.unlink()
    with pytest.raises(TlsError, match=r"tls\.key_file = .*key\.pem does not exist"):
        verify_certificate_pair(cert, key)


def test_expired_pair_is_replaced_with_a_key_of_mode_0600_even_over_an_open_file(
    tmp_path: Path,
) -> None:
    cert, key = _pair(tmp_path)
    ensure_self_signed_certificate(cert, key)
    private_key = serialization.load_pem_private_key(key.read_bytes(), password=None)
    assert isinstance(private_key, ec.EllipticCurvePrivateKey)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired")])
    past = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    expired = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private_key.public_key())
        .serial_number(1)
        .not_valid_before(past)
        .not_valid_after(past + datetime.timedelta(days=1))
        .sign(private_key, hashes.SHA256())
    )
    cert.write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    key.chmod(0o644)  # left open by hand, or by an older version
    assert ensure_self_signed_certificate(cert, key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    verify_certificate_pair(cert, key)


def test_a_fresh_pair_replaces_a_usable_one(tmp_path: Path) -> None:
    """An attested appliance makes its TLS key at each start (appliance.server, tee.mode =
    required): a pair from before is never served again."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    ensure_self_signed_certificate(cert, key)
    before = certificate_spki_sha256(cert)
    assert ensure_self_signed_certificate(cert, key, fresh=True)
    assert certificate_spki_sha256(cert) != before
    verify_certificate_pair(cert, key)


def test_the_spki_hash_is_of_the_certificates_der_subject_public_key_info(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    ensure_self_signed_certificate(cert, key)
    certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert certificate_spki_sha256(cert) == hashlib.sha256(spki).digest()
