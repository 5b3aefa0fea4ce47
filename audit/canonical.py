"""RFC 8785 JSON Canonicalization Scheme (JCS): the exact bytes every audit entry is hashed as.

Writer side only: the log canonicalizes an entry once, hashes those bytes and stores them; readers
and the offline verifier work on the stored bytes and never re-serialize.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from audit.errors import CanonicalJsonError

JsonValue: TypeAlias = (
    "bool | int | float | str | Sequence[JsonValue] | Mapping[str, JsonValue] | None"
)

# I-JSON (RFC 7493, section 2.2), which RFC 8785 requires: integers beyond this are not exactly
# representable as IEEE 754 doubles, so two parsers could read them differently.
MAX_SAFE_INTEGER = 2**53 - 1


def canonicalize(value: JsonValue) -> bytes:
    """Return the RFC 8785 canonical UTF-8 encoding of `value`.

    Raises CanonicalJsonError for values JSON cannot carry canonically: NaN or infinite floats,
    integers outside +-(2**53 - 1), non-string object keys, unpaired surrogates, or types other
    than None, bool, int, float, str, sequences and mappings.
    """
    parts: list[str] = []
    _serialize(value, parts)
    try:
        return "".join(parts).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CanonicalJsonError(f"string holds an unpaired surrogate: {exc.reason}") from exc


def parse_canonical(data: bytes | str) -> JsonValue:
    """Parse JSON text reading numbers as RFC 8785 does, as IEEE 754 doubles: an integer literal
    beyond +-(2**53 - 1) (how a large integral double canonicalizes: 1e20 is
    "100000000000000000000") becomes a float, so `canonicalize(parse_canonical(canonicalize(v)))`
    gives the same bytes for every value `canonicalize` accepts. Raises ValueError for invalid
    JSON."""
    return json.loads(data, parse_int=_parse_integer)


def _parse_integer(text: str) -> int | float:
    number = int(text)
    return number if abs(number) <= MAX_SAFE_INTEGER else float(text)


def _serialize(value: JsonValue, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_serialize_string(value))
    elif isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            raise CanonicalJsonError(f"integer {value} is outside the I-JSON range +-(2**53 - 1)")
        out.append(str(value))
    elif isinstance(value, float):
        out.append(serialize_number(value))
    elif isinstance(value, Mapping):
        _serialize_object(value, out)
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        if _is_safe_integer_array(value):
            # A prompt's token ids, most of what the log commits to: in one join, not one call
            # per element (the same bytes: a safe integer is written as its decimal digits).
            out.append("[" + ",".join(map(str, value)) + "]")
            return
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _serialize(item, out)
        out.append("]")
    else:
        raise CanonicalJsonError(f"{type(value).__name__} is not a JSON value")


def _is_safe_integer_array(value: Sequence[JsonValue]) -> bool:
    """Whether `value` is non-empty and holds only ints (not bools, not int subclasses) within
    +-(2**53 - 1)."""
    return (
        bool(value)
        and all(type(item) is int for item in value)
        and -MAX_SAFE_INTEGER <= min(value) <= max(value) <= MAX_SAFE_INTEGER  # type: ignore[type-var]
    )


def _serialize_object(value: Mapping[str, JsonValue], out: list[str]) -> None:
    for key in value:
        if not isinstance(key, str):
            raise CanonicalJsonError(f"object key {key!r} is not a string")
    # RFC 8785, section 3.2.3: members sorted by their names as arrays of UTF-16 code units.
    # Big-endian UTF-16 bytes compare exactly as the code units do.
    keys = sorted(value, key=lambda k: k.encode("utf-16-be", "surrogatepass"))
    out.append("{")
    for i, key in enumerate(keys):
        if i:
            out.append(",")
        out.append(_serialize_string(key))
        out.append(":")
        _serialize(value[key], out)
    out.append("}")


def _serialize_string(value: str) -> str:
    # RFC 8785, section 3.2.2.2: exactly ECMAScript's JSON.stringify escaping, which is what
    # Python's encoder does without ensure_ascii (\b \t \n \f \r \" \\ and lowercase \u00XX for
    # the other controls; everything else literal).
    return json.dumps(value, ensure_ascii=False)


def serialize_number(value: float) -> str:
    """Serialize a double as ECMAScript's Number.prototype.toString does (RFC 8785, 3.2.2.3)."""
    if not math.isfinite(value):
        raise CanonicalJsonError(f"{value} has no JSON representation")
    if value == 0:
        return "0"  # also for -0.0
    sign = "-" if value < 0 else ""
    # repr() gives the shortest digit string that round-trips, which is the digit string
    # ECMAScript requires; only the layout around it differs.
    mantissa, _, exponent = repr(abs(value)).partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    digits = int_part + frac_part
    # value = 0.digits * 10**n (ECMA-262, Number::toString, step 5 names them k digits and n).
    n = len(int_part) + (int(exponent) if exponent else 0)
    stripped = digits.lstrip("0")
    n -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    e = n - 1
    exp = f"e{'+' if e >= 0 else '-'}{abs(e)}"
    if k == 1:
        return sign + digits + exp
    return sign + digits[0] + "." + digits[1:] + exp
