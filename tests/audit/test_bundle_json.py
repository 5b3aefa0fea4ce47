"""The limits on the JSON the offline verifier reads (issue 13, defect 2): the depth counted
without recursion agrees with a naive recursive count of the parsed value; a document 100,000
levels deep, over its size limit or not UTF-8 is a BundleFormatError, never RecursionError."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from audit.bundle_json import MAX_NESTING_DEPTH, nesting_depth, parse_entry, parse_json
from audit.canonical import canonicalize
from audit.errors import BundleFormatError

DEEP = 100_000

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.text(alphabet='[]{}"\\,:ab\n\u00e9\u2603'),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(alphabet='[]{}"\\ab'), children, max_size=4)
    ),
    max_leaves=30,
)


def naive_depth(value: Any) -> int:
    """The reference: nesting depth by recursion over the parsed value."""
    if isinstance(value, list):
        return 1 + max(map(naive_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(naive_depth, value.values()), default=0)
    return 0


@given(json_values)
def test_depth_agrees_with_the_naive_recursive_count(value: Any) -> None:
    assert nesting_depth(json.dumps(value).encode()) == naive_depth(value)
    assert nesting_depth(canonicalize(value)) == naive_depth(value)


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_100000_levels_deep_is_a_bundle_format_error(opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    deep = opener * DEEP + b"1" + closer * DEEP
    with pytest.raises(BundleFormatError, match=f"x nests .* deeper than {MAX_NESTING_DEPTH}"):
        parse_json(deep, what="x", max_bytes=1 << 20)
    with pytest.raises(BundleFormatError, match=f"x nests .* deeper than {MAX_NESTING_DEPTH}"):
        parse_entry(deep, what="x")


def test_the_depth_limit_is_inclusive_and_strings_do_not_count() -> None:
    at_limit = b"[" * MAX_NESTING_DEPTH + b"]" * MAX_NESTING_DEPTH
    assert parse_json(at_limit, what="x", max_bytes=1000) is not None
    with pytest.raises(BundleFormatError, match="deeper than"):
        parse_json(b"[" + at_limit + b"]", what="x", max_bytes=1000)
    assert parse_entry(canonicalize({"s": "[" * DEEP + '\\"{'}), what="x")


def test_over_its_size_limit_or_not_utf8_is_a_bundle_format_error() -> None:
    with pytest.raises(BundleFormatError, match="over the limit of 10 bytes"):
        parse_json(b"[" + b"1," * 10 + b"1]", what="x", max_bytes=10)
    with pytest.raises(BundleFormatError, match="not valid JSON: it is not UTF-8"):
        parse_json('["\u00e9"]'.encode("utf-16"), what="x", max_bytes=100)
