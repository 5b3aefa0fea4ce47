"""Limits on the outside input the attestation package parses: JSON documents (GPU and CPU
evidence, Intel's DCAP collateral, sealed-model manifests) and the TOML policy file.

Python's `json` and `tomllib` parse nested arrays and objects (and TOML inline tables) by
recursion: 100,000 opening brackets raise RecursionError, a crash instead of an answer, and a
large enough document exhausts memory. Every document is therefore checked before it is parsed,
against a size limit its caller names (the `MAX_*_BYTES` below) and against
MAX_NESTING_DEPTH. The depth is counted in one linear pass over the text, outside strings (and,
for TOML, comments), with regular expressions and no recursion, before the parser runs. Each
check raises the caller's own error type, so every trust boundary keeps its one error type.

For text a parser would reject, the depth counted is an upper bound of the depth the parser
reaches before it stops: up to the point where the text stops being valid, both tokenize it the
same way. A RecursionError that escapes all the same (it cannot for valid JSON) is translated
too: a parser's recursion guard is never a crash here.
"""

from __future__ import annotations

import json
import re
import tomllib
from array import array
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any

# No honest document read here nests deeper than 6 (Intel's TCB info); the margin is wide, and
# 64 levels stay far below the interpreter's recursion limit (1000 frames) in any caller.
MAX_NESTING_DEPTH = 64
# Evidence of 8 GPUs is about 100 KiB (NVIDIA's PPCIe file: 99 KiB).
MAX_GPU_EVIDENCE_BYTES = 4 << 20
# A SEV-SNP report with its certificate table, or a TDX quote, is under 16 KiB.
MAX_CPU_EVIDENCE_BYTES = 1 << 20
MAX_POLICY_BYTES = 1 << 20
# dcap-qvl's collateral for one platform is 16 KiB; a CRL of many revoked PCKs can grow.
MAX_COLLATERAL_BYTES = 4 << 20

ErrorType = Callable[[str], Exception]

# A JSON string: quote, then runs of plain bytes and escapes (unrolled so that a long string
# costs one pass), then quote. Quotes, backslashes and brackets are ASCII, and no byte of a
# multi-byte UTF-8 sequence is ASCII, so the scan runs on the encoded bytes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# What TOML brackets can hide in: multi-line basic and literal strings (which may end in up to
# two extra quotes), basic and literal strings, and comments.
_TOML_SKIPPED = re.compile(
    rb'"""(?:[^"\\]|\\.|"(?!""))*"{0,2}"""'
    rb"|'''.*?'{0,2}'''"
    rb'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"'
    rb"|'[^'\n]*'"
    rb"|#[^\n]*",
    re.DOTALL,
)
# Openers become +1 and closers -1 (as signed bytes), everything else is deleted: the running
# sum of what is left is the depth.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def nesting_depth(data: bytes, *, toml: bool = False) -> int:
    """The deepest nesting of arrays and objects (inline tables) in the UTF-8 JSON (or TOML)
    document `data`, counted outside strings (and comments) in linear time, without
    recursion."""
    outside = (_TOML_SKIPPED if toml else _JSON_STRING).sub(b"", data)
    steps = array("b", outside.translate(_STEPS, _NOT_BRACKETS))
    return max(accumulate(steps), default=0)


def read_file(path: Path, *, what: str, error: ErrorType, max_bytes: int) -> bytes:
    """The bytes of the file at `path`, reading no more than `max_bytes` + 1 of them (a file
    over the limit is refused without being read whole). Raises `error`."""
    try:
        with Path(path).open("rb") as file:
            data = file.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise error(f"{what} {path} is over the limit of {max_bytes} bytes")
    return data


def parse_json(data: bytes | str, *, what: str, error: ErrorType, max_bytes: int) -> Any:
    """Parse the JSON document `data` (`what` names it in messages) after checking its size
    and nesting depth. Raises `error` for a document over `max_bytes`, not UTF-8 (RFC 8259,
    section 8.1), nested deeper than MAX_NESTING_DEPTH, or not JSON; never RecursionError."""
    text = _checked_text(data, what=what, error=error, max_bytes=max_bytes, kind="JSON")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error(f"{what} is not JSON: {exc}") from exc
    except RecursionError:
        raise error(f"{what} nests too deep to parse") from None


def parse_toml(data: bytes | str, *, what: str, error: ErrorType, max_bytes: int) -> Any:
    """Parse the TOML document `data` as `parse_json` parses JSON, with the same limits."""
    text = _checked_text(data, what=what, error=error, max_bytes=max_bytes, kind="TOML")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} is not valid TOML: {exc}") from exc
    except RecursionError:
        raise error(f"{what} nests too deep to parse") from None


def _checked_text(
    data: bytes | str, *, what: str, error: ErrorType, max_bytes: int, kind: str
) -> str:
    """`data` as text, after the checks of size, encoding and depth (`kind`: JSON or TOML)."""
    if isinstance(data, str):
        if len(data) > max_bytes:  # every character is at least one byte
            raise error(f"{what} is over the limit of {max_bytes} bytes")
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, over the limit of {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} is not {kind}: it is not UTF-8 text") from None
    # Every bracket, even one inside a string, bounds the depth: most documents need no scan.
    if data.count(b"[") + data.count(b"{") > MAX_NESTING_DEPTH and (
        nesting_depth(data, toml=kind == "TOML") > MAX_NESTING_DEPTH
    ):
        raise error(
            f"{what} nests arrays and objects deeper than {MAX_NESTING_DEPTH} levels, the limit"
        )
    return text
