"""RFC 8785 canonical JSON against the RFC's own examples and cyberphone's reference test data.

The number table is RFC 8785, Appendix B (IEEE 754 bit patterns and their ECMAScript strings);
the object examples are cyberphone/json-canonicalization's testdata `values.json` and
`weird.json` (Apache-2.0), the reference implementation's inputs and expected outputs.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audit.canonical import canonicalize, parse_canonical, serialize_number
from audit.errors import CanonicalJsonError

APPENDIX_B = {
    "0000000000000000": "0",
    "8000000000000000": "0",
    "0000000000000001": "5e-324",
    "8000000000000001": "-5e-324",
    "7fefffffffffffff": "1.7976931348623157e+308",
    "ffefffffffffffff": "-1.7976931348623157e+308",
    "4340000000000000": "9007199254740992",
    "c340000000000000": "-9007199254740992",
    "4430000000000000": "295147905179352830000",
    "44b52d02c7e14af5": "9.999999999999997e+22",
    "44b52d02c7e14af6": "1e+23",
    "44b52d02c7e14af7": "1.0000000000000001e+23",
    "444b1ae4d6e2ef4e": "999999999999999700000",
    "444b1ae4d6e2ef4f": "999999999999999900000",
    "444b1ae4d6e2ef50": "1e+21",
    "3eb0c6f7a0b5ed8c": "9.999999999999997e-7",
    "3eb0c6f7a0b5ed8d": "0.000001",
    "41b3de4355555553": "333333333.3333332",
    "41b3de4355555554": "333333333.33333325",
    "41b3de4355555555": "333333333.3333333",
    "41b3de4355555556": "333333333.3333334",
    "41b3de4355555557": "333333333.33333343",
    "becbf647612f3696": "-0.0000033333333333333333",
    "43143ff3c1cb0959": "1424953923781206.2",
}


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B.items())
def test_number_serializes_as_rfc_8785_appendix_b(bits: str, expected: str) -> None:
    (value,) = struct.unpack(">d", bytes.fromhex(bits))
    assert serialize_number(value) == expected


@pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000", "fff0000000000000"])
def test_nan_and_infinities_are_refused(bits: str) -> None:
    (value,) = struct.unpack(">d", bytes.fromhex(bits))
    with pytest.raises(CanonicalJsonError, match="no JSON representation"):
        canonicalize({"x": value})


def test_values_example_matches_the_reference_output() -> None:
    source = (
        '{"numbers": [1E30, 4.50, 333333333.33333329, 2e-3, 0.000000000000000000000000001],'
        r' "escaping": "\u20ac$\u000F\u000aA'
        "'"
        r'\u0042\u0022\u005c\\\"\/",'
        ' "literals": [null, true, false]}'
    )
    expected = (
        r'{"escaping":"€$\u000f\nA'
        "'"
        r'B\"\\\\\"/","literals":[null,true,false],'
        '"numbers":[1e+30,4.5,333333333.3333333,0.002,1e-27]}'
    )
    assert canonicalize(json.loads(source)) == expected.encode()


def test_members_sort_by_utf16_code_units_not_code_points() -> None:
    source = (
        r'{"\u20ac": "Euro Sign", "1": "One", "\u0080": "Control\u007f",'
        r' "\ud83d\ude02": "Smiley", "\u00f6": "Latin Small Letter O With Diaeresis",'
        r' "\ufb33": "Hebrew Letter Dalet With Dagesh", "</script>": "Browser Challenge"}'
    )
    expected = (
        '{"1":"One","</script>":"Browser Challenge","\u0080":"Control\u007f",'
        '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
        '"\U0001f602":"Smiley","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
    )
    # U+1F602 (UTF-16 D83D DE02) sorts before U+FB33, although its code point is larger.
    assert canonicalize(json.loads(source)) == expected.encode()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"n": 2**53}, "outside the I-JSON range"),
        ({1: "x"}, "object key 1 is not a string"),
        ({"s": "\ud800"}, "unpaired surrogate"),
        ({"b": b"bytes"}, "bytes is not a JSON value"),
        ({"o": object()}, "object is not a JSON value"),
    ],
)
def test_values_without_a_canonical_form_are_refused(value: object, message: str) -> None:
    with pytest.raises(CanonicalJsonError, match=message):
        canonicalize(value)  # type: ignore[arg-type]


def test_integers_tuples_and_nesting_serialize_without_whitespace() -> None:
    value = {"b": [1, -2, (3, None)], "a": {"z": True, "y": 0.5}, "c": 2**53 - 1}
    assert (
        canonicalize(value) == b'{"a":{"y":0.5,"z":true},"b":[1,-2,[3,null]],"c":9007199254740991}'
    )


def test_integer_arrays_serialize_as_every_other_array_does() -> None:
    # Token-id arrays take a faster path (one join); bools, int subclasses and integers out of
    # range must still be written, or refused, as elsewhere.
    assert canonicalize([3, -1, 0, 2**53 - 1, -(2**53 - 1)]) == (
        b"[3,-1,0,9007199254740991,-9007199254740991]"
    )
    assert canonicalize((7, 8)) == b"[7,8]"
    assert canonicalize([1, True, False]) == b"[1,true,false]"
    assert canonicalize([1, 2.5]) == b"[1,2.5]"
    assert canonicalize([[1, 2], []]) == b"[[1,2],[]]"
    with pytest.raises(CanonicalJsonError, match="outside the I-JSON range"):
        canonicalize([1, 2**53])
    with pytest.raises(CanonicalJsonError, match="outside the I-JSON range"):
        canonicalize([-(2**53), 1])


def test_a_large_integral_double_reads_back_as_the_same_canonical_bytes() -> None:
    # 1e20 canonicalizes as an integer literal that Python's json would read as an int
    # outside the I-JSON range, which canonicalize then refuses.
    data = canonicalize({"x": 1e20, "y": -(2.0**60), "z": 2**53 - 1})
    assert data == b'{"x":100000000000000000000,"y":-1152921504606847000,"z":9007199254740991}'
    assert canonicalize(parse_canonical(data)) == data


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**53) + 1, 2**53 - 1)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=16,
    )
)
def test_canonical_bytes_survive_a_parse(value: object) -> None:
    data = canonicalize(value)  # type: ignore[arg-type]
    assert canonicalize(parse_canonical(data)) == data
