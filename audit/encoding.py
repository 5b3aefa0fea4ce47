"""The two text encodings of the C2SP formats: standard base64 and unsigned decimal numbers."""

from __future__ import annotations

import base64
import binascii
import re

from audit.errors import NoteFormatError

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")


def decode_base64(text: str, what: str) -> bytes:
    """Decode RFC 4648 section 4 base64, refusing anything else; `what` names it in errors."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise NoteFormatError(f"{what} is not valid base64") from exc


def encode_base64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def parse_decimal(text: str, what: str) -> int:
    """An ASCII decimal without leading zeros (up to 19 digits); `what` names it in errors."""
    if not _DECIMAL.fullmatch(text):
        raise NoteFormatError(f"{what} {text[:30]!r} is not a decimal number without leading zeros")
    return int(text)
