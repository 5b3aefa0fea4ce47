"""The limits on JSON and TOML input (issue 13, defect 2): the depth counted without recursion
agrees with a naive recursive count of the parsed value; documents 100,000 levels deep, over
their size limit or not UTF-8 raise the caller's error type, never RecursionError."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attestation.errors import EvidenceError, PolicyError
from attestation.input_limits import (
    MAX_NESTING_DEPTH,
    nesting_depth,
    parse_json,
    parse_toml,
    read_file,
)

DEEP = 100_000

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet="[]{}\"\\'#,:ab\n\u00e9\u2603"),
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


@given(json_values, st.booleans())
def test_json_depth_agrees_with_the_naive_recursive_count(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert nesting_depth(text.encode()) == naive_depth(value)


@pytest.mark.parametrize(
    ("document", "depth"),
    [
        ("a = 1", 0),
        ("a = [1, [2, {b = [3]}]]", 4),
        ('a = "[[[" # [[[[', 0),
        ("a = '[[[' # {{{", 0),
        ('a = """\n[[[ "" \\""" [[\n"""', 0),
        ('a = """[[[""""', 0),
        ("a = '''\n[[[ '' [[\n'''", 0),
        ("a = ''''[['''' \n b = [1]", 1),
        ('a = "\\"[[[" \n b = [[1]]', 2),
        ("[table]\n[[array.of.tables]]\nx = [1]", 2),
    ],
)
def test_toml_depth_skips_strings_and_comments(document: str, depth: int) -> None:
    tomllib.loads(document)  # each is valid TOML
    assert nesting_depth(document.encode(), toml=True) == depth


def _nested_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_json_100000_levels_deep_raises_the_callers_error(opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    with pytest.raises(EvidenceError, match=f"deeper than {MAX_NESTING_DEPTH} levels"):
        parse_json(opener * DEEP + "1" + closer * DEEP, what="x", error=EvidenceError,
                   max_bytes=1 << 20)  # fmt: skip


def test_json_at_the_depth_limit_parses_and_one_deeper_does_not() -> None:
    assert parse_json(_nested_json(MAX_NESTING_DEPTH), what="x", error=EvidenceError,
                      max_bytes=1000) is not None  # fmt: skip
    with pytest.raises(EvidenceError, match="deeper than"):
        parse_json(_nested_json(MAX_NESTING_DEPTH + 1), what="x", error=EvidenceError,
                   max_bytes=1000)  # fmt: skip


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"prompt": "[" * DEEP + '\\"' + "{" * DEEP})
    assert parse_json(text, what="x", error=EvidenceError, max_bytes=1 << 20)


@pytest.mark.parametrize(
    "document",
    [
        "a = " + "[" * DEEP + "]" * DEEP,
        "a = " + "{b = " * DEEP + "1" + "}" * DEEP,
        "a = [" + "[1, {c = " * DEEP,  # unterminated: refused before tomllib recurses
    ],
)
def test_toml_100000_levels_deep_raises_the_callers_error(document: str) -> None:
    with pytest.raises(PolicyError, match="deeper than"):
        parse_toml(document, what="policy", error=PolicyError, max_bytes=4 << 20)


@pytest.mark.parametrize("data", [b"[" + b"0," * 600 + b"0]", "[" + "0," * 600 + "0]"])
def test_document_over_its_size_limit_is_refused(data: bytes | str) -> None:
    with pytest.raises(EvidenceError, match="over the limit of 1000 bytes"):
        parse_json(data, what="x", error=EvidenceError, max_bytes=1000)


def test_json_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(EvidenceError, match="not UTF-8"):
        parse_json('["\u00e9"]'.encode("utf-16"), what="x", error=EvidenceError, max_bytes=100)


def test_file_over_its_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 5000)
    assert len(read_file(path, what="x", error=EvidenceError, max_bytes=5000)) == 5000
    with pytest.raises(EvidenceError, match="over the limit of 4999 bytes"):
        read_file(path, what="x", error=EvidenceError, max_bytes=4999)
    with pytest.raises(EvidenceError, match="does not exist"):
        read_file(tmp_path / "missing", what="x", error=EvidenceError, max_bytes=10)
