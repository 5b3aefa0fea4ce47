"""Commitments to request content: HMAC-SHA256 under a per-deployment secret key.

Audit entries must prove which prompt and response a request had without holding either. A plain
hash would let anyone with the log confirm a guessed prompt; a keyed hash (RFC 2104) can only be
recomputed by whoever holds the deployment's key, who can then show that a disputed text is the
one committed to. The label separates prompts from responses, so one cannot stand for the other.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from audit.canonical import JsonValue, canonicalize
from audit.encoding import encode_base64
from audit.errors import KeyFileError
from audit.keyfile import load_or_create_secret, read_secret_file

KEY_SIZE = 32
ALGORITHM = "hmac-sha256"


class ContentCommitter:
    """Computes `hmac-sha256:<key id>:<base64 tag>` commitments. Holds a secret; never log it."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise KeyFileError(f"commitment key must be {KEY_SIZE} bytes, not {len(key)}")
        self._key = key
        # Names the key in each commitment, so a rotated key does not silently mismatch.
        self.key_id = hashlib.sha256(b"inferno commitment key\n" + key).hexdigest()[:16]

    @classmethod
    def load_or_create(cls, path: Path) -> ContentCommitter:
        """The deployment's commitment key, created at first start as an owner-only file."""
        return cls(load_or_create_secret(path, lambda: secrets.token_bytes(KEY_SIZE)))

    @classmethod
    def load(cls, path: Path) -> ContentCommitter:
        """An existing commitment key (one key shared by the appliances of a deployment): never
        created here, so that a mistyped path cannot start a second, unrelated key."""
        try:
            return cls(read_secret_file(path))
        except FileNotFoundError:
            raise KeyFileError(
                f"commitment key file {path} does not exist; copy the deployment's key there "
                "(mode 0600), or leave the setting out to make a key for this appliance alone"
            ) from None

    def __repr__(self) -> str:
        return f"ContentCommitter(key_id={self.key_id})"

    def commit(self, label: str, content: str | bytes | JsonValue) -> str:
        """Commit to `content`: bytes as they are, text as UTF-8, anything else as canonical JSON.

        `label` says what the content is ("prompt", "response", ...).
        """
        if isinstance(content, bytes):
            data = content
        elif isinstance(content, str):
            data = content.encode("utf-8")
        else:
            data = canonicalize(content)
        tag = hmac.new(self._key, label.encode() + b"\x00" + data, hashlib.sha256).digest()
        return f"{ALGORITHM}:{self.key_id}:{encode_base64(tag)}"

    def matches(self, label: str, content: str | bytes | JsonValue, commitment: str) -> bool:
        """Whether `commitment` commits to `content` under this key (constant-time compare)."""
        return hmac.compare_digest(self.commit(label, content), commitment)
