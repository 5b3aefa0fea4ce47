"""The sealed-model errors: one subclass of `SealedModelError` per step of opening and
decrypting a sealed model, so a test (and an operator reading the message) can tell which step
refused it. Messages never carry key material or plaintext."""

from __future__ import annotations

from attestation.errors import SealedModelError


class ManifestSignatureError(SealedModelError):
    """Step 1: the manifest is missing, or its Ed25519 signature does not verify under the pinned
    manifest key (tampered, or signed by someone else)."""


class ManifestFormatError(SealedModelError):
    """Step 2: a manifest whose signature verifies but whose content is not a valid manifest of
    this format version (a signer bug, or a version this code does not read)."""


class SealedFileError(SealedModelError):
    """Step 3: a file the manifest lists is missing, has the wrong size (truncated or extended),
    or, for a plain file, the wrong digest."""


class DataKeyMismatchError(SealedModelError):
    """Step 4: the data key offered is not the one this model was sealed with."""


class ChunkAuthenticationError(SealedModelError):
    """Step 5: a chunk's AES-GCM tag does not verify: a flipped bit, a chunk moved to another
    position, file or seal, or a truncated chunk. The caller's buffer has been zeroed."""
