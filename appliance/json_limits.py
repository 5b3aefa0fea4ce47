"""Limits on the JSON the appliance reads from outside: request bodies, and identity providers'
discovery documents and JWK Sets (fetched, pinned in a file, or cached on disk).

Python's `json` parses nested arrays and objects by recursion: 100,000 opening brackets raise
RecursionError, a crash instead of an answer. Every document is therefore checked before it is
parsed: its size, and its nesting depth against MAX_NESTING_DEPTH, counted in one linear pass
over the bytes outside strings, without recursion. The check raises the caller's error type
(`parse_json`), or JsonNestingError for a request body, which FastAPI parses itself
(`check_request_body`, called by appliance.api.middleware.BodySizeLimit).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any

# Honest documents nest a few levels (a chat request with content parts: 5; a tool's JSON Schema
# a dozen or two); 64 stays far below the interpreter's recursion limit in any caller.
MAX_NESTING_DEPTH = 64

# A JSON string: quote, runs of plain bytes and escapes, quote. Quotes, backslashes and
# brackets are ASCII, and no byte of a multi-byte UTF-8 sequence is, so the scan runs on bytes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Openers become +1 and closers -1 (as signed bytes), everything else is deleted: the running
# sum of what is left is the depth.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


class JsonNestingError(ValueError):
    """A JSON document nests arrays and objects deeper than MAX_NESTING_DEPTH."""


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in the UTF-8 JSON text `data`, counted outside
    strings in linear time, without recursion. For text that is not JSON, an upper bound of the
    depth a parser reaches before it fails (both tokenize the valid prefix alike)."""
    steps = array("b", _JSON_STRING.sub(b"", data).translate(_STEPS, _NOT_BRACKETS))
    return max(accumulate(steps), default=0)


def check_nesting(data: bytes, what: str) -> None:
    """Raise JsonNestingError if the UTF-8 JSON text `data` nests deeper than the limit."""
    # Every bracket, even one inside a string, bounds the depth: most documents need no scan.
    if data.count(b"[") + data.count(b"{") > MAX_NESTING_DEPTH and (
        nesting_depth(data) > MAX_NESTING_DEPTH
    ):
        raise JsonNestingError(
            f"{what} nests JSON arrays and objects deeper than {MAX_NESTING_DEPTH} levels, "
            "the limit"
        )


def check_request_body(body: bytes) -> None:
    """Raise JsonNestingError if `body`, read as `json.loads` reads bytes (UTF-8, or UTF-16 or
    UTF-32 as its first bytes show: what FastAPI parses), nests deeper than the limit."""
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        try:
            body = body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
        except UnicodeError:
            return  # not text in that encoding: json.loads refuses it before parsing anything
    check_nesting(body, "the request body")


def parse_json(
    data: bytes | str, *, what: str, error: Callable[[str], Exception], max_bytes: int
) -> Any:
    """Parse the UTF-8 JSON document `data` (`what` names it in messages) after checking its
    size and nesting depth. Raises `error`, never RecursionError."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > max_bytes:
        raise error(f"{what} is over the limit of {max_bytes} bytes")
    try:
        check_nesting(data, what)
        return json.loads(data.decode("utf-8"))
    except JsonNestingError as exc:
        raise error(str(exc)) from exc
    except ValueError as exc:  # UnicodeDecodeError is one
        raise error(f"{what} is not JSON: {exc}") from exc
