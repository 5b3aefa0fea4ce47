"""Owner-only key files and the checkpoint signer that refuses to sign a fork."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from audit.checkpoint import Checkpoint, open_checkpoint
from audit.errors import KeyFileError, SignerRefusedError
from audit.keyfile import load_or_create_secret, read_secret_file, write_file_atomically
from audit.merkle import TreeFrontier, consistency_proof_plan, hash_leaf, resolve_plan
from audit.signer import CheckpointSigner, load_note_signer, load_or_create_note_signer

ORIGIN = "inferno.test/signer"


def test_signing_key_is_created_owner_only_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "log.key"
    first = load_or_create_note_signer(path, ORIGIN)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert load_or_create_note_signer(path, ORIGIN).verifier == first.verifier


def test_a_key_file_open_to_others_is_refused_and_its_content_not_shown(tmp_path: Path) -> None:
    path = tmp_path / "log.key"
    signer = load_or_create_note_signer(path, ORIGIN)
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match="mode 0640, open to group or others") as info:
        load_or_create_note_signer(path, ORIGIN)
    assert signer.to_skey().split("+", 4)[4] not in str(info.value)


def test_a_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "real.key"
    load_or_create_note_signer(target, ORIGIN)
    (tmp_path / "link.key").symlink_to(target)
    with pytest.raises(KeyFileError, match="cannot open secret file"):
        read_secret_file(tmp_path / "link.key")


def test_a_key_of_another_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.key"
    load_or_create_note_signer(path, ORIGIN)
    with pytest.raises(KeyFileError, match=r"is the key of log 'inferno\.test/signer'"):
        load_or_create_note_signer(path, "inferno.test/other")


def test_loading_an_existing_key_never_creates_one(tmp_path: Path) -> None:
    path = tmp_path / "log.key"
    with pytest.raises(KeyFileError, match=r"there is no signing key at .*log\.key yet"):
        load_note_signer(path, ORIGIN)
    assert not path.exists()
    made = load_or_create_note_signer(path, ORIGIN)
    assert load_note_signer(path, ORIGIN).verifier == made.verifier
    with pytest.raises(KeyFileError, match="is the key of log"):
        load_note_signer(path, "inferno.test/other")


def test_concurrent_atomic_writers_of_one_file_never_fail_or_mix(tmp_path: Path) -> None:
    path = tmp_path / "state.note"
    contents = [f"writer {i}\n".encode() * 1000 for i in range(8)]

    def write(content: bytes) -> None:
        for _ in range(50):
            write_file_atomically(path, content)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, contents))
    assert path.read_bytes() in contents
    assert [p.name for p in tmp_path.iterdir()] == ["state.note"]


def test_an_existing_secret_is_never_regenerated(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    assert load_or_create_secret(path, lambda: b"first") == b"first"
    assert load_or_create_secret(path, lambda: b"second") == b"first"


class Tree:
    def __init__(self) -> None:
        self.frontier, self.nodes = TreeFrontier(), {}

    def grow(self, count: int) -> Checkpoint:
        for _ in range(count):
            self.nodes.update(self.frontier.append(hash_leaf(os.urandom(8))))
        return Checkpoint(ORIGIN, self.frontier.size, self.frontier.root())

    def proof(self, size1: int, size2: int) -> list[bytes]:
        return resolve_plan(consistency_proof_plan(size1, size2), self.nodes)


def _signer(tmp_path: Path) -> CheckpointSigner:
    note_signer = load_or_create_note_signer(tmp_path / "log.key", ORIGIN)
    return CheckpointSigner(note_signer, tmp_path / "state.note")


def test_signer_signs_a_consistent_extension_and_remembers_it_across_restarts(
    tmp_path: Path,
) -> None:
    tree, signer = Tree(), _signer(tmp_path)
    first = tree.grow(5)
    note = signer.sign(first, [])
    assert open_checkpoint(note, signer.verifier) == first
    second = tree.grow(6)
    signer.sign(second, tree.proof(5, 11))
    assert _signer(tmp_path).last_signed == second


def test_signer_refuses_a_fork_of_what_it_signed(tmp_path: Path) -> None:
    tree, fork, signer = Tree(), Tree(), _signer(tmp_path)
    signer.sign(tree.grow(4), [])
    forked = fork.grow(7)
    with pytest.raises(SignerRefusedError, match="does not extend the last signed checkpoint"):
        signer.sign(forked, fork.proof(4, 7))
    assert signer.last_signed.size == 4


def test_signer_refuses_a_smaller_tree_and_an_empty_one(tmp_path: Path) -> None:
    tree, signer = Tree(), _signer(tmp_path)
    small = tree.grow(3)
    signer.sign(tree.grow(2), [])
    with pytest.raises(SignerRefusedError, match="size 3 is smaller than the last signed size 5"):
        signer.sign(small, [])
    with pytest.raises(SignerRefusedError, match="empty log"):
        signer.sign(Checkpoint(ORIGIN, 0, bytes(32)), [])


def test_signer_refuses_a_tampered_state_file(tmp_path: Path) -> None:
    tree, signer = Tree(), _signer(tmp_path)
    signer.sign(tree.grow(3), [])
    state = tmp_path / "state.note"
    state.write_text(state.read_text().replace("\n3\n", "\n1\n"))
    with pytest.raises(KeyFileError, match="is not a checkpoint signed by this log's key"):
        _signer(tmp_path)
