"""TLS material: check the operator's certificate and key, or make the demo's self-signed pair.

The server always speaks TLS (plain HTTP only behind `server.insecure_http`). A self-signed
certificate is trusted by pinning: clients are told its SHA-256 fingerprint, or given the file.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance.errors import TlsError
from audit.errors import KeyFileError
from audit.keyfile import read_secret_file

SELF_SIGNED_VALIDITY = datetime.timedelta(days=365)
_ALWAYS_NAMED = ("localhost", "127.0.0.1", "::1")


def ensure_self_signed_certificate(
    cert_file: Path, key_file: Path, hostnames: Iterable[str] = (), *, fresh: bool = False
) -> bool:
    """Make a self-signed certificate and key at these paths unless a usable pair is there, or
    always with `fresh` (an attested appliance makes its key at each start, inside the TEE: the
    attestation binds it, so no key from before this boot is ever served).

    The certificate names localhost, 127.0.0.1, ::1 and `hostnames` (DNS names or IP
    addresses). An expired certificate is replaced. Returns True when a new pair was made.
    Raises `TlsError` when only one of the two files exists (refusing to guess which is stale).
    """
    have_cert, have_key = cert_file.exists(), key_file.exists()
    if have_cert != have_key:
        present, missing = (cert_file, key_file) if have_cert else (key_file, cert_file)
        raise TlsError(f"{present} exists but {missing} does not; remove {present} to make a pair")
    if have_cert and not fresh and not _expired(cert_file):
        return False
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Inferno demo appliance")])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + SELF_SIGNED_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(_general_names(hostnames)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key_file.parent.mkdir(parents=True, exist_ok=True)
    cert_file.parent.mkdir(parents=True, exist_ok=True)
    _write_private(key_file, key_pem)
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return True


def verify_certificate_pair(cert_file: Path, key_file: Path) -> None:
    """Raise `TlsError` unless the server could start TLS with this certificate chain and key,
    and the key file is kept as every secret file of the appliance is (`read_secret_file`): a
    regular file, not a symlink, owned by this user, with no group or other permission bit."""
    try:
        read_secret_file(key_file)
    except FileNotFoundError:
        raise TlsError(f"tls.key_file = {key_file} does not exist") from None
    except KeyFileError as exc:
        raise TlsError(f"tls.key_file: {exc}") from exc
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        # The ssl error names no file and never quotes key material.
        raise TlsError(
            f"cannot use tls.cert_file = {cert_file} with tls.key_file = {key_file}: {exc}; "
            "give a PEM certificate chain and its unencrypted PEM private key"
        ) from exc


def certificate_fingerprint(cert_file: Path) -> str:
    """The certificate's SHA-256 fingerprint as colon-separated hex (as `openssl x509
    -fingerprint -sha256` prints it)."""
    digest = _load(cert_file).fingerprint(hashes.SHA256())
    return ":".join(f"{byte:02X}" for byte in digest)


def certificate_spki_sha256(cert_file: Path) -> bytes:
    """SHA-256 of the DER SubjectPublicKeyInfo of the certificate the server presents (the first
    of the chain in `cert_file`): what the attestation evidence binds as the TLS channel
    (attestation.binding.Channel), and what a client compares with its connection's peer."""
    public_key = _load(cert_file).public_key()
    spki = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


def _load(cert_file: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError) as exc:
        raise TlsError(f"cannot read the certificate {cert_file}: {exc}") from exc


def _expired(cert_file: Path) -> bool:
    return _load(cert_file).not_valid_after_utc <= datetime.datetime.now(datetime.UTC)


def _general_names(hostnames: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*_ALWAYS_NAMED, *hostnames]):
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            names.append(x509.DNSName(host))
            continue
        if not address.is_unspecified:  # 0.0.0.0 and :: listen everywhere; they name no host
            names.append(x509.IPAddress(address))
    return names


def _write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read, never briefly readable by others. An existing file
    (an expired pair's key) keeps its mode through O_TRUNC, so the mode is set before writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), 0o600)
        file.write(data)
