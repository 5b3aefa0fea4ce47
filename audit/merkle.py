"""RFC 6962 / RFC 9162 Merkle tree: hashing, roots, proof construction and proof verification.

Pure functions over hashes. Trees are append-only logs of `size` leaves; a *node* is the root of a
perfect subtree, named by its level (0 for leaves) and its index within that level, so node
(level, index) covers leaves [index * 2**level, (index + 1) * 2**level). Every node of a log is
immutable once its last leaf exists, which is what lets the store keep them and build any proof
from O(log n) of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from audit.errors import MerkleError, RootMismatchError

HASH_SIZE = 32
# RFC 9162, section 2.1.1: the hash of an empty tree is the hash of the empty string.
EMPTY_ROOT = hashlib.sha256(b"").digest()


class NodeId(NamedTuple):
    level: int
    index: int


def hash_leaf(data: bytes) -> bytes:
    """MTH of a single leaf: SHA-256(0x00 || data) (RFC 6962, section 2.1)."""
    return hashlib.sha256(b"\x00" + data).digest()


def hash_children(left: bytes, right: bytes) -> bytes:
    """An interior node: SHA-256(0x01 || left || right) (RFC 6962, section 2.1)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def perfect_subtrees(begin: int, end: int) -> list[NodeId]:
    """The nodes that tile leaves [begin, end), left to right, each as large as alignment allows.

    For the ranges RFC 6962's recursion produces (and for every prefix [0, size)) the sizes
    decrease from left to right, so folding the node hashes from the right gives the range's MTH.
    """
    if not 0 <= begin <= end:
        raise ValueError(f"bad leaf range [{begin}, {end})")
    nodes = []
    while begin < end:
        level = (begin & -begin).bit_length() - 1 if begin else (end - begin).bit_length() - 1
        while begin + (1 << level) > end:
            level -= 1
        nodes.append(NodeId(level, begin >> level))
        begin += 1 << level
    return nodes


def fold_right(hashes: Sequence[bytes]) -> bytes:
    """The root of adjacent subtrees of decreasing size: h0 | (h1 | (h2 | ...))."""
    if not hashes:
        return EMPTY_ROOT
    root = hashes[-1]
    for left in reversed(hashes[:-1]):
        root = hash_children(left, root)
    return root


class TreeFrontier:
    """The roots of the perfect subtrees of a log of `size` leaves: enough to append and hash it.

    This is RFC 9162's compact range of [0, size): at most one node per set bit of `size`.
    """

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()) -> None:
        if len(hashes) != size.bit_count():
            raise MerkleError(
                f"a frontier of size {size} has {size.bit_count()} hashes, not {len(hashes)}"
            )
        self.size = size
        self.hashes = list(hashes)

    @staticmethod
    def nodes_for(size: int) -> list[NodeId]:
        """The node ids whose hashes make up the frontier of `size` leaves."""
        return perfect_subtrees(0, size)

    def append(self, leaf_hash: bytes) -> list[tuple[NodeId, bytes]]:
        """Add the next leaf; return every node it completes, the leaf itself first."""
        node, value = NodeId(0, self.size), leaf_hash
        completed = [(node, value)]
        while node.index & 1:  # a right child: merge with the left sibling
            value = hash_children(self.hashes.pop(), value)
            node = NodeId(node.level + 1, node.index >> 1)
            completed.append((node, value))
        self.hashes.append(value)
        self.size += 1
        return completed

    def root(self) -> bytes:
        return fold_right(self.hashes)


def root_of(leaf_hashes: Iterable[bytes]) -> bytes:
    """The MTH of a whole list of leaf hashes."""
    frontier = TreeFrontier()
    for leaf_hash in leaf_hashes:
        frontier.append(leaf_hash)
    return frontier.root()


def _largest_power_of_two_below(n: int) -> int:
    return 1 << ((n - 1).bit_length() - 1)


def inclusion_proof_plan(index: int, size: int) -> list[list[NodeId]]:
    """The nodes that make up the inclusion proof of leaf `index` in a tree of `size` leaves.

    RFC 6962, section 2.1.1 (PATH): from the leaf's sibling up to the root's child.
    """
    if not 0 <= index < size:
        raise MerkleError(f"leaf {index} is not in a tree of {size} leaves")
    begin, end, ranges = 0, size, []
    while end - begin > 1:
        split = begin + _largest_power_of_two_below(end - begin)
        if index < split:
            ranges.append((split, end))
            end = split
        else:
            ranges.append((begin, split))
            begin = split
    return [perfect_subtrees(b, e) for b, e in reversed(ranges)]


def consistency_proof_plan(size1: int, size2: int) -> list[list[NodeId]]:
    """The nodes that make up the consistency proof between tree sizes `size1` and `size2`.

    RFC 6962, section 2.1.2 (PROOF and SUBPROOF). Requires 0 < size1 <= size2.
    """
    if not 0 < size1 <= size2:
        raise MerkleError(f"no consistency proof from size {size1} to size {size2}")
    ranges: list[tuple[int, int]] = []
    begin, end, complete = 0, size2, True
    m = size1
    while m != end - begin:
        k = _largest_power_of_two_below(end - begin)
        if m <= k:
            ranges.append((begin + k, end))
            end = begin + k
        else:
            ranges.append((begin, begin + k))
            m -= k
            begin += k
            complete = False
    if not complete:
        ranges.append((begin, end))
    return [perfect_subtrees(b, e) for b, e in reversed(ranges)]


def resolve_plan(plan: Sequence[Sequence[NodeId]], nodes: Mapping[NodeId, bytes]) -> list[bytes]:
    """Turn a proof plan into the proof, given the hashes of (at least) the nodes it names."""
    return [fold_right([nodes[node] for node in element]) for element in plan]


def _check_hash(name: str, value: bytes) -> None:
    if len(value) != HASH_SIZE:
        raise MerkleError(f"{name} is {len(value)} bytes, not {HASH_SIZE}")


def root_from_inclusion_proof(
    index: int, size: int, leaf_hash: bytes, proof: Sequence[bytes]
) -> bytes:
    """The root that `proof` implies for `leaf_hash` at `index` (RFC 9162, section 2.1.3.2)."""
    if not 0 <= index < size:
        raise MerkleError(f"leaf index {index} is not below tree size {size}")
    _check_hash("leaf hash", leaf_hash)
    fn, sn, r = index, size - 1, leaf_hash
    for i, p in enumerate(proof):
        _check_hash(f"proof element {i}", p)
        if sn == 0:
            raise MerkleError(
                f"inclusion proof has {len(proof)} elements, more than the tree needs"
            )
        if fn & 1 or fn == sn:
            r = hash_children(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = hash_children(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise MerkleError(f"inclusion proof has {len(proof)} elements, fewer than the tree needs")
    return r


def verify_inclusion(
    index: int, size: int, leaf_hash: bytes, proof: Sequence[bytes], root: bytes
) -> None:
    """Return if `proof` puts `leaf_hash` at `index` in the tree `size`/`root`; else raise."""
    calculated = root_from_inclusion_proof(index, size, leaf_hash, proof)
    if calculated != root:
        raise RootMismatchError(expected=root, calculated=calculated)


def verify_consistency(
    size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes
) -> None:
    """Return if `proof` shows tree `size1`/`root1` is a prefix of tree `size2`/`root2`; else raise.

    RFC 9162, section 2.1.4.2. Equal sizes need an empty proof and equal roots; a proof from the
    empty tree is meaningless and refused (even to itself), as transparency-dev/merkle does.
    """
    if size1 > size2:
        raise MerkleError(f"size1 {size1} is larger than size2 {size2}")
    if size1 == 0:
        raise MerkleError("a consistency proof from the empty tree is meaningless")
    if size1 == size2:
        if proof:
            raise MerkleError("the sizes are equal but the consistency proof is not empty")
        if root1 != root2:
            raise RootMismatchError(expected=root2, calculated=root1)
        return
    if not proof:
        raise MerkleError("the consistency proof is empty")
    _check_hash("root1", root1)
    for i, p in enumerate(proof):
        _check_hash(f"proof element {i}", p)
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # size1 is a power of two: its root is the first element
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise MerkleError(f"consistency proof has {len(proof)} elements, more than needed")
        if fn & 1 or fn == sn:
            fr = hash_children(c, fr)
            sr = hash_children(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = hash_children(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise MerkleError(f"consistency proof has {len(proof)} elements, fewer than needed")
    if fr != root1:
        raise RootMismatchError(expected=root1, calculated=fr)
    if sr != root2:
        raise RootMismatchError(expected=root2, calculated=sr)
