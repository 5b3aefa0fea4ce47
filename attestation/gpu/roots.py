"""The pinned roots: NVIDIA's Device Identity CA (root of every Hopper device certificate chain)
and NVIDIA's CoRIM signing root (root of every RIM signing chain), as published in NVIDIA's
nvtrust repository (Apache-2.0). Each is checked against its SHA-256 fingerprint when loaded, so
an edit to the PEM text cannot silently change the trust anchor.

A deployment may pin other roots (`GpuTrust.from_paths(roots_dir=...)`); tests pin synthetic ones.
"""

from __future__ import annotations

import hashlib

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.errors import PolicyError

DEVICE_IDENTITY_CA_FILE = "nvidia_device_identity_ca.pem"
CORIM_ROOT_FILE = "nvidia_corim_signing_root_ca.pem"

NVIDIA_DEVICE_IDENTITY_CA_SHA256 = (
    "102bf659d5419614c9d8e6aecebc80454eb26b1df6a769ac720b9a690b167b48"
)
NVIDIA_CORIM_ROOT_SHA256 = "12977b5115acb0381179279fffeb5a8c4d264971ebb32298023a465fa41df5d1"

NVIDIA_DEVICE_IDENTITY_CA_PEM = """\
-----BEGIN CERTIFICATE-----
MIICCzCCAZCgAwIBAgIQLTZwscoQBBHB/sDoKgZbVDAKBggqhkjOPQQDAzA1MSIw
IAYDVQQDDBlOVklESUEgRGV2aWNlIElkZW50aXR5IENBMQ8wDQYDVQQKDAZOVklE
SUEwIBcNMjExMTA1MDAwMDAwWhgPOTk5OTEyMzEyMzU5NTlaMDUxIjAgBgNVBAMM
GU5WSURJQSBEZXZpY2UgSWRlbnRpdHkgQ0ExDzANBgNVBAoMBk5WSURJQTB2MBAG
ByqGSM49AgEGBSuBBAAiA2IABA5MFKM7+KViZljbQSlgfky/RRnEQScW9NDZF8SX
gAW96r6u/Ve8ZggtcYpPi2BS4VFu6KfEIrhN6FcHG7WP05W+oM+hxj7nyA1r1jkB
2Ry70YfThX3Ba1zOryOP+MJ9vaNjMGEwDwYDVR0TAQH/BAUwAwEB/zAOBgNVHQ8B
Af8EBAMCAQYwHQYDVR0OBBYEFFeF/4PyY8xlfWi3Olv0jUrL+0lfMB8GA1UdIwQY
MBaAFFeF/4PyY8xlfWi3Olv0jUrL+0lfMAoGCCqGSM49BAMDA2kAMGYCMQCPeFM3
TASsKQVaT+8S0sO9u97PVGCpE9d/I42IT7k3UUOLSR/qvJynVOD1vQKVXf0CMQC+
EY55WYoDBvs2wPAH1Gw4LbcwUN8QCff8bFmV4ZxjCRr4WXTLFHBKjbfneGSBWwA=
-----END CERTIFICATE-----
"""

NVIDIA_CORIM_ROOT_PEM = """\
-----BEGIN CERTIFICATE-----
MIICKTCCAbCgAwIBAgIQRdrjoA5QN73fh1N17LXicDAKBggqhkjOPQQDAzBFMQsw
CQYDVQQGEwJVUzEPMA0GA1UECgwGTlZJRElBMSUwIwYDVQQDDBxOVklESUEgQ29S
SU0gc2lnbmluZyBSb290IENBMCAXDTIzMDMxNjE1MzczNFoYDzIwNTMwMzA4MTUz
NzM0WjBFMQswCQYDVQQGEwJVUzEPMA0GA1UECgwGTlZJRElBMSUwIwYDVQQDDBxO
VklESUEgQ29SSU0gc2lnbmluZyBSb290IENBMHYwEAYHKoZIzj0CAQYFK4EEACID
YgAEuECyi9vNM+Iw2lfUzyBldHAwaC1HF7TCgp12QcEyUTm3Tagxwr48d55+K2VI
lWYIDk7NlAIQdcV/Ff7euGLI+Qauj93HsSI4WX298PpW54RTgz9tC+Q684caR/BX
WEeZo2MwYTAdBgNVHQ4EFgQUpaXrOPK4ZDAk08DBskn594zeZjAwHwYDVR0jBBgw
FoAUpaXrOPK4ZDAk08DBskn594zeZjAwDwYDVR0TAQH/BAUwAwEB/zAOBgNVHQ8B
Af8EBAMCAQYwCgYIKoZIzj0EAwMDZwAwZAIwHGDyscDP6ihHqRvZlI3eqZ4YkvjE
1duaN84tAHRVgxVMvNrp5Tnom3idHYGW/dskAjATvjIx6VzHm/4e2GiZAyZEIUBD
OKPzp5ei/A0iUZpdvngenDwV8Qa/wGdiTmJ7Bp4=
-----END CERTIFICATE-----
"""


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER encoding, lowercase hex."""
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


def load_pinned_root(pem: bytes | str, expected_sha256: str | None = None) -> x509.Certificate:
    """One PEM certificate, optionally checked against its SHA-256 DER fingerprint.
    Raises PolicyError: a trust anchor that cannot be read is a configuration error."""
    data = pem.encode("ascii") if isinstance(pem, str) else pem
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise PolicyError(f"pinned root is not a PEM certificate: {exc}") from exc
    if len(certs) != 1:
        raise PolicyError(f"a pinned root file must hold one certificate, not {len(certs)}")
    if expected_sha256 is not None and fingerprint(certs[0]) != expected_sha256:
        raise PolicyError(
            f"pinned root fingerprint {fingerprint(certs[0])} is not {expected_sha256}"
        )
    return certs[0]


def nvidia_device_identity_ca() -> x509.Certificate:
    return load_pinned_root(NVIDIA_DEVICE_IDENTITY_CA_PEM, NVIDIA_DEVICE_IDENTITY_CA_SHA256)


def nvidia_corim_root() -> x509.Certificate:
    return load_pinned_root(NVIDIA_CORIM_ROOT_PEM, NVIDIA_CORIM_ROOT_SHA256)
