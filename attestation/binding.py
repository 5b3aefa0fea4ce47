"""The 64-byte report_data a CPU report signs, binding one attestation to one challenge.

`report_data(nonce, gpu_evidence_digest, key_release_public_key)` =
    SHA-512( DOMAIN ‖ len(nonce) ‖ nonce ‖ len(digest) ‖ digest ‖ len(key) ‖ key )
with each length a 4-byte big-endian integer and DOMAIN = b"inferno/attestation/report_data/v1\\0".

Why each part: the nonce makes the report fresh (no replay of an old report); the GPU evidence
digest ties the GPUs' evidence to this CPU TEE (no splicing of another machine's GPUs); the
key-release public key says which key the TEE holds, so that whoever releases a model key (or
checks a signed verdict) knows the party that proved itself is the party it talks to. Length
prefixes make the encoding injective (no two part lists give the same bytes), and the domain
string keeps the hash from meaning anything in another protocol. SHA-512 fills the 64 bytes
that SEV-SNP's REPORT_DATA and TDX's REPORTDATA both hold.
"""

from __future__ import annotations

import hashlib
import struct

from attestation.errors import AttestationError

DOMAIN = b"inferno/attestation/report_data/v1\0"
NONCE_SIZE = 32
GPU_EVIDENCE_DIGEST_SIZE = 32


class BindingError(AttestationError, ValueError):
    """A part of the binding has the wrong size (a caller's mistake, not hostile evidence)."""


def report_data(nonce: bytes, gpu_evidence_digest: bytes, key_release_public_key: bytes) -> bytes:
    """The 64-byte report_data for a challenge `nonce` (32 bytes), the SHA-256 digest of the GPU
    evidence (`attestation.gpu.gpu_evidence_digest`, 32 bytes) and the key-release public key
    (its encoded bytes, e.g. raw Ed25519 or DER SubjectPublicKeyInfo; non-empty; the verifier
    must use the same encoding). Raises BindingError on a wrong size."""
    if len(nonce) != NONCE_SIZE:
        raise BindingError(f"the nonce must be {NONCE_SIZE} bytes, got {len(nonce)}")
    if len(gpu_evidence_digest) != GPU_EVIDENCE_DIGEST_SIZE:
        raise BindingError(
            f"the GPU evidence digest must be {GPU_EVIDENCE_DIGEST_SIZE} bytes (SHA-256), "
            f"got {len(gpu_evidence_digest)}"
        )
    if not key_release_public_key:
        raise BindingError("the key-release public key is empty")
    digest = hashlib.sha512(DOMAIN)
    for part in (nonce, gpu_evidence_digest, key_release_public_key):
        digest.update(struct.pack(">I", len(part)))
        digest.update(part)
    return digest.digest()
