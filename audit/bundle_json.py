"""Limits on the JSON the offline verifier reads from a bundle: its manifest, each entry line,
and the auditor's state file. Standard library only, like the verifier.

Python's `json` parses nested arrays and objects by recursion: 100,000 opening brackets raise
RecursionError, a crash instead of an answer. Every document is therefore checked before it is
parsed: its size against the limit below, that it is UTF-8 (RFC 8259, section 8.1; RFC 8785
entries are UTF-8 by definition), and its nesting depth against MAX_NESTING_DEPTH, counted in
one linear pass over the bytes outside strings, without recursion. Each check raises
BundleFormatError (the input is unusable: exit status 2).
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate

from audit.canonical import JsonValue, parse_canonical
from audit.errors import BundleFormatError

# An entry nests 5 deep at most (attestation.verdict: details.claims.gpu.gpus[i].rims); 64
# leaves room and stays far below the interpreter's recursion limit.
MAX_NESTING_DEPTH = 64
# Entries hold commitments and verdicts, never content: a few KiB. The writer bounds none, so
# the limit is generous.
MAX_ENTRY_BYTES = 1 << 20
# The manifest lists every checkpoint size of the export: 16 MiB holds over a million.
MAX_MANIFEST_BYTES = 16 << 20
MAX_STATE_BYTES = 1 << 20  # a state file is 200 bytes
# A checkpoint is a signed note of a few hundred bytes (audit.note allows 100 signatures).
MAX_CHECKPOINT_BYTES = 64 << 10

# A JSON string: quote, runs of plain bytes and escapes, quote. Quotes, backslashes and
# brackets are ASCII, and no byte of a multi-byte UTF-8 sequence is, so the scan runs on bytes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Openers become +1 and closers -1 (as signed bytes), everything else is deleted: the running
# sum of what is left is the depth.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in the UTF-8 JSON text `data`, counted outside
    strings in linear time, without recursion. For text that is not JSON, an upper bound of the
    depth a parser reaches before it fails (both tokenize the valid prefix alike)."""
    steps = array("b", _JSON_STRING.sub(b"", data).translate(_STEPS, _NOT_BRACKETS))
    return max(accumulate(steps), default=0)


def checked_json_text(data: bytes, *, what: str, max_bytes: int) -> str:
    """`data` decoded, after the checks of size, encoding and depth. Raises BundleFormatError."""
    if len(data) > max_bytes:
        raise BundleFormatError(f"{what} is over the limit of {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BundleFormatError(f"{what} is not valid JSON: it is not UTF-8 text") from None
    # Every bracket, even one inside a string, bounds the depth: most documents need no scan.
    if data.count(b"[") + data.count(b"{") > MAX_NESTING_DEPTH and (
        nesting_depth(data) > MAX_NESTING_DEPTH
    ):
        raise BundleFormatError(
            f"{what} nests arrays and objects deeper than {MAX_NESTING_DEPTH} levels, the limit"
        )
    return text


def parse_json(data: bytes, *, what: str, max_bytes: int) -> object:
    """Parse the JSON document `data` within the limits. Raises BundleFormatError, never
    RecursionError."""
    text = checked_json_text(data, what=what, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise BundleFormatError(f"{what} is not valid JSON: {exc}") from exc


def parse_entry(data: bytes, *, what: str) -> JsonValue:
    """Parse an entry's stored bytes as `audit.canonical.parse_canonical` does, within
    MAX_ENTRY_BYTES and MAX_NESTING_DEPTH. Raises BundleFormatError."""
    text = checked_json_text(data, what=what, max_bytes=MAX_ENTRY_BYTES)
    try:
        return parse_canonical(text)
    except ValueError as exc:
        raise BundleFormatError(f"{what} is not valid JSON: {exc}") from exc
