"""The 64-byte report_data a CPU report signs, binding one attestation to one challenge, and the
GPU nonces derived from that challenge.

Two versioned domains; the appliance requests v2, and v1 stays verifiable for evidence stored
before v2 existed:

    v1: SHA-512( DOMAIN_V1 ‖ len ‖ nonce ‖ len ‖ gpu_evidence_digest ‖ len ‖ key )
    v2: SHA-512( DOMAIN_V2 ‖ len ‖ nonce ‖ len ‖ gpu_evidence_digest ‖ len ‖ key
                 ‖ len ‖ tls_spki_sha256 ‖ len ‖ audit_vkey )

with each length a 4-byte big-endian integer, DOMAIN_V1 = b"inferno/attestation/report_data/v1\\0"
and DOMAIN_V2 = b"inferno/attestation/report_data/v2\\0".

Why each part: the nonce makes the report fresh (no replay of an old report); the GPU evidence
digest ties the GPUs' evidence to this CPU TEE (no splicing of another machine's GPUs); the
attestation (key-release) public key says which key the TEE holds, so that whoever releases a
model key (or checks a signed verdict) knows the party that proved itself is the party it talks
to. v2 adds the channel (`Channel`): the SHA-256 of the serving TLS certificate's
SubjectPublicKeyInfo, so that a client can tell that the TLS connection it talks on ends inside
this TEE (a TLS-terminating relay with a certificate of its own cannot pass the TEE's evidence
off as its own), and the audit log's verifier key, so that a client knows which log records its
requests. Length prefixes make the encoding injective (no two part lists give the same bytes;
an absent channel part is the empty string, which no present one is), and the domain string
keeps the hash from meaning anything in another protocol. SHA-512 fills the 64 bytes that
SEV-SNP's REPORT_DATA and TDX's REPORTDATA both hold.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from attestation.errors import AttestationError

DOMAIN = DOMAIN_V1 = b"inferno/attestation/report_data/v1\0"
DOMAIN_V2 = b"inferno/attestation/report_data/v2\0"
NONCE_SIZE = 32
GPU_EVIDENCE_DIGEST_SIZE = 32
SPKI_SHA256_SIZE = 32
MAX_AUDIT_VKEY_BYTES = 1024  # a C2SP vkey is ~100 bytes: origin, key hash, base64 Ed25519 key
_GPU_NONCE_CONTEXT = b"inferno.gpu-nonce.v1\x00"


class BindingError(AttestationError, ValueError):
    """A part of the binding has the wrong size (a caller's mistake, not hostile evidence)."""


@dataclass(frozen=True, slots=True)
class Channel:
    """What v2 binds besides the challenge, the GPU evidence and the attestation key: the
    SHA-256 of the serving TLS certificate's DER SubjectPublicKeyInfo (None: the appliance
    serves plain HTTP, so there is no channel to bind, and a client that checks the binding
    refuses it) and the audit log's verifier key, a C2SP note vkey (None: none bound)."""

    tls_spki_sha256: bytes | None
    audit_vkey: str | None

    def __post_init__(self) -> None:
        spki = self.tls_spki_sha256
        if spki is not None and len(spki) != SPKI_SHA256_SIZE:
            raise BindingError(
                f"the TLS SPKI hash must be {SPKI_SHA256_SIZE} bytes (SHA-256), got {len(spki)}"
            )
        if self.audit_vkey is not None and not (
            0 < len(self.audit_vkey.encode()) <= MAX_AUDIT_VKEY_BYTES
        ):
            raise BindingError(f"the audit vkey must be 1 to {MAX_AUDIT_VKEY_BYTES} bytes")

    def parts(self) -> tuple[bytes, bytes]:
        return (self.tls_spki_sha256 or b"", (self.audit_vkey or "").encode())


NO_CHANNEL = Channel(None, None)


def report_data(nonce: bytes, gpu_evidence_digest: bytes, key_release_public_key: bytes) -> bytes:
    """The v1 report_data for a challenge `nonce` (32 bytes), the SHA-256 digest of the GPU
    evidence (`attestation.gpu.gpu_evidence_digest`, 32 bytes) and the key-release public key
    (its encoded bytes, e.g. raw Ed25519 or DER SubjectPublicKeyInfo; non-empty; the verifier
    must use the same encoding). Raises BindingError on a wrong size."""
    _check_parts(nonce, gpu_evidence_digest, key_release_public_key)
    return _digest(DOMAIN_V1, (nonce, gpu_evidence_digest, key_release_public_key))


def report_data_v2(
    nonce: bytes, gpu_evidence_digest: bytes, attestation_public_key: bytes, channel: Channel
) -> bytes:
    """The v2 report_data: v1's three parts, then the channel's TLS SPKI hash and audit vkey
    (each the empty string when absent). Raises BindingError on a wrong size."""
    _check_parts(nonce, gpu_evidence_digest, attestation_public_key)
    return _digest(
        DOMAIN_V2, (nonce, gpu_evidence_digest, attestation_public_key, *channel.parts())
    )


def gpu_nonces(challenge: bytes, num_gpus: int) -> list[bytes]:
    """The SPDM nonce of GPU `i` (NVML's device order) for `challenge`:
    SHA-256("inferno.gpu-nonce.v1" ‖ 0x00 ‖ challenge ‖ i as 4 bytes big-endian). Deriving them,
    rather than drawing one per GPU, lets a client that sent one nonce recompute every nonce it
    must find in the GPU reports."""
    if len(challenge) != NONCE_SIZE:
        raise BindingError(f"a challenge is {NONCE_SIZE} bytes")
    return [
        hashlib.sha256(_GPU_NONCE_CONTEXT + challenge + index.to_bytes(4, "big")).digest()
        for index in range(num_gpus)
    ]


def _check_parts(nonce: bytes, gpu_evidence_digest: bytes, public_key: bytes) -> None:
    if len(nonce) != NONCE_SIZE:
        raise BindingError(f"the nonce must be {NONCE_SIZE} bytes, got {len(nonce)}")
    if len(gpu_evidence_digest) != GPU_EVIDENCE_DIGEST_SIZE:
        raise BindingError(
            f"the GPU evidence digest must be {GPU_EVIDENCE_DIGEST_SIZE} bytes (SHA-256), "
            f"got {len(gpu_evidence_digest)}"
        )
    if not public_key:
        raise BindingError("the key-release public key is empty")


def _digest(domain: bytes, parts: Iterable[bytes]) -> bytes:
    digest = hashlib.sha512(domain)
    for part in parts:
        digest.update(struct.pack(">I", len(part)))
        digest.update(part)
    return digest.digest()
