"""RFC 6962 Merkle tree: the transparency-dev probes, and proofs built here against a naive tree.

The probes are transparency-dev/merkle's testdata (Apache-2.0, LICENSE beside them), copied into
`tests/audit/vectors/merkle` so a clone tests on its own (regenerate them with that repository's
`go generate ./testdata`).
Each file is one verification call with `wantErr`; every inclusion and consistency file is used.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from audit.errors import MerkleError
from audit.merkle import (
    EMPTY_ROOT,
    NodeId,
    TreeFrontier,
    consistency_proof_plan,
    hash_children,
    hash_leaf,
    inclusion_proof_plan,
    perfect_subtrees,
    resolve_plan,
    root_of,
    verify_consistency,
    verify_inclusion,
)

VECTORS = Path(__file__).resolve().parent / "vectors" / "merkle"
# The eight leaves of RFC 6962's (and Certificate Transparency's) classic test tree.
CT_LEAVES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
CT_ROOT_8 = "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"


def _b64(value: str | None) -> bytes:
    return base64.b64decode(value or "")


def _probes(kind: str) -> list[Path]:
    files = sorted((VECTORS / kind).rglob("*.json"))
    if not files:
        pytest.fail(f"no {kind} vectors under {VECTORS}")
    return files


def _probe_id(path: Path) -> str:
    return str(path.relative_to(VECTORS))


@pytest.mark.parametrize("path", _probes("inclusion"), ids=_probe_id)
def test_inclusion_probe_matches_transparency_dev(path: Path) -> None:
    probe = json.loads(path.read_text())
    proof = [_b64(p) for p in probe["proof"] or []]
    args = (
        probe["leafIdx"],
        probe["treeSize"],
        _b64(probe["leafHash"]),
        proof,
        _b64(probe["root"]),
    )
    if probe["wantErr"]:
        with pytest.raises(MerkleError):
            verify_inclusion(*args)
    else:
        verify_inclusion(*args)


@pytest.mark.parametrize("path", _probes("consistency"), ids=_probe_id)
def test_consistency_probe_matches_transparency_dev(path: Path) -> None:
    probe = json.loads(path.read_text())
    proof = [_b64(p) for p in probe["proof"] or []]
    args = (probe["size1"], probe["size2"], proof, _b64(probe["root1"]), _b64(probe["root2"]))
    if probe["wantErr"]:
        with pytest.raises(MerkleError):
            verify_consistency(*args)
    else:
        verify_consistency(*args)


def naive_root(leaves: list[bytes]) -> bytes:
    """RFC 6962, section 2.1, MTH written as the recursion the RFC states."""
    if not leaves:
        return EMPTY_ROOT
    if len(leaves) == 1:
        return hash_leaf(leaves[0])
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return hash_children(naive_root(leaves[:k]), naive_root(leaves[k:]))


def naive_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 6962, section 2.1.1, PATH(m, D[n])."""
    if len(leaves) == 1:
        return []
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    if m < k:
        return [*naive_path(m, leaves[:k]), naive_root(leaves[k:])]
    return [*naive_path(m - k, leaves[k:]), naive_root(leaves[:k])]


def naive_subproof(m: int, leaves: list[bytes], complete: bool) -> list[bytes]:
    """RFC 6962, section 2.1.2, SUBPROOF(m, D[n], b)."""
    n = len(leaves)
    if m == n:
        return [] if complete else [naive_root(leaves)]
    k = 1 << ((n - 1).bit_length() - 1)
    if m <= k:
        return [*naive_subproof(m, leaves[:k], complete), naive_root(leaves[k:])]
    return [*naive_subproof(m - k, leaves[k:], False), naive_root(leaves[:k])]


class NaiveTree:
    """Every node of a tree, hashed straight from the leaves, as a store would hold them."""

    def __init__(self, leaves: list[bytes]) -> None:
        self.leaves = leaves

    def __getitem__(self, node: NodeId) -> bytes:
        begin = node.index << node.level
        return naive_root(self.leaves[begin : begin + (1 << node.level)])


def test_frontier_root_of_ct_leaves_is_the_published_root() -> None:
    assert root_of(hash_leaf(leaf) for leaf in CT_LEAVES).hex() == CT_ROOT_8


def test_empty_tree_root_is_sha256_of_nothing() -> None:
    assert root_of([]) == hashlib.sha256(b"").digest() == TreeFrontier().root()


@given(st.lists(st.binary(max_size=8), min_size=1, max_size=70))
def test_frontier_matches_naive_root_at_every_size_and_reports_every_completed_node(
    leaves: list[bytes],
) -> None:
    frontier, tree, stored = TreeFrontier(), NaiveTree(leaves), {}
    for size, leaf in enumerate(leaves, start=1):
        for node, value in frontier.append(hash_leaf(leaf)):
            assert value == tree[node]
            stored[node] = value
        assert frontier.root() == naive_root(leaves[:size])
        # Every node completed so far was reported exactly when it completed.
        assert set(stored) == {
            NodeId(level, index)
            for level in range(size.bit_length())
            for index in range(size >> level)
        }


@given(st.lists(st.binary(max_size=4), min_size=1, max_size=70), st.data())
def test_inclusion_proof_from_nodes_equals_rfc_path_and_verifies(
    leaves: list[bytes], data: st.DataObject
) -> None:
    size = len(leaves)
    index = data.draw(st.integers(0, size - 1))
    proof = resolve_plan(inclusion_proof_plan(index, size), NaiveTree(leaves))
    assert proof == naive_path(index, leaves)
    verify_inclusion(index, size, hash_leaf(leaves[index]), proof, naive_root(leaves))


@given(st.lists(st.binary(max_size=4), min_size=1, max_size=70), st.data())
def test_consistency_proof_from_nodes_equals_rfc_proof_and_verifies(
    leaves: list[bytes], data: st.DataObject
) -> None:
    size2 = len(leaves)
    size1 = data.draw(st.integers(1, size2))
    proof = resolve_plan(consistency_proof_plan(size1, size2), NaiveTree(leaves))
    assert proof == naive_subproof(size1, leaves, True)
    verify_consistency(size1, size2, proof, naive_root(leaves[:size1]), naive_root(leaves))


def test_consistency_verification_rejects_a_rewritten_older_tree() -> None:
    leaves = [bytes([i]) for i in range(11)]
    forged = [*leaves[:4], b"forged", *leaves[5:]]
    proof = resolve_plan(consistency_proof_plan(7, 11), NaiveTree(leaves))
    with pytest.raises(MerkleError):
        verify_consistency(7, 11, proof, naive_root(forged[:7]), naive_root(leaves))


def test_frontier_rebuilt_from_stored_nodes_continues_the_same_tree() -> None:
    leaves = [bytes([i]) for i in range(13)]
    tree = NaiveTree(leaves)
    frontier = TreeFrontier(10, [tree[node] for node in TreeFrontier.nodes_for(10)])
    for leaf in leaves[10:]:
        frontier.append(hash_leaf(leaf))
    assert frontier.root() == naive_root(leaves)


def test_frontier_refuses_a_hash_count_that_does_not_match_its_size() -> None:
    with pytest.raises(MerkleError, match="a frontier of size 3 has 2 hashes, not 1"):
        TreeFrontier(3, [EMPTY_ROOT])


def test_perfect_subtrees_tile_an_unaligned_range_with_the_largest_aligned_nodes() -> None:
    assert perfect_subtrees(4, 11) == [NodeId(2, 1), NodeId(1, 4), NodeId(0, 10)]
    assert perfect_subtrees(0, 8) == [NodeId(3, 0)]
    assert perfect_subtrees(5, 5) == []


def test_inclusion_plan_refuses_a_leaf_beyond_the_tree() -> None:
    with pytest.raises(MerkleError, match="leaf 5 is not in a tree of 5 leaves"):
        inclusion_proof_plan(5, 5)
