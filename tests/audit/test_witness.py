"""The witness's core (audit.witness): what it cosigns, what it refuses with which status, and
that a refusal leaves its state as it was, across restarts too. Trees are hashed by the naive
RFC 6962 recursion of test_merkle, not by the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from audit.checkpoint import Checkpoint, open_checkpoint
from audit.cosignature import Cosigner, verify_cosignatures
from audit.encoding import encode_base64
from audit.errors import (
    InconsistentCheckpointError,
    OldSizeConflictError,
    SplitViewError,
    UnknownLogError,
    UntrustedCheckpointError,
    WitnessRefusedError,
    WitnessStateError,
)
from audit.note import NoteSigner, SignedNote
from audit.witness import MAX_PROOF_LINES, MAX_REQUEST_BYTES, AddCheckpointRequest, Witness
from tests.audit.test_merkle import naive_root, naive_subproof

ORIGIN = "inferno.test/witnessed"
NOW = 1_700_000_000
LOG = NoteSigner.generate(ORIGIN)
COSIGNER = Cosigner.generate("witness.test/w1")


def _leaves(n: int, fork: str = "") -> list[bytes]:
    return [f"entry {i}{fork if i == n - 1 else ''}".encode() for i in range(n)]


def _note(leaves: list[bytes], signer: NoteSigner = LOG) -> str:
    return Checkpoint(signer.name, len(leaves), naive_root(leaves)).sign(signer)


def _body(old: list[bytes] | None, new: list[bytes], note: str | None = None) -> bytes:
    """An add-checkpoint body from the tree `old` (None: size 0) to the tree `new`."""
    old_size = 0 if old is None else len(old)
    proof = naive_subproof(old_size, new, True) if 0 < old_size < len(new) else []
    lines = [f"old {old_size}", *(encode_base64(h) for h in proof)]
    return ("\n".join(lines) + "\n\n" + (note or _note(new))).encode()


@pytest.fixture
def state_path(tmp_path: Path) -> Path:
    return tmp_path / "witness-state.json"


@pytest.fixture
def witness(state_path: Path) -> Witness:
    return Witness(COSIGNER, [LOG.verifier], state_path)


def _cosigned_by_witness(note: str, line: str) -> bool:
    return bool(verify_cosignatures(SignedNote.parse(note + line), [COSIGNER.verifier]))


def test_first_checkpoint_from_old_size_zero_is_cosigned_and_recorded(
    witness: Witness, state_path: Path
) -> None:
    tree = _leaves(5)
    line = witness.add_checkpoint(_body(None, tree), NOW)
    assert _cosigned_by_witness(_note(tree), line)
    assert witness.latest(ORIGIN) == Checkpoint(ORIGIN, 5, naive_root(tree))
    assert json.loads(state_path.read_text())["logs"][ORIGIN] == _note(tree)


@pytest.mark.parametrize(("size1", "size2"), [(1, 2), (3, 7), (4, 8), (5, 5), (6, 13)])
def test_an_extension_proven_consistent_is_cosigned(
    witness: Witness, size1: int, size2: int
) -> None:
    leaves = _leaves(size2)
    witness.add_checkpoint(_body(None, leaves[:size1]), NOW)
    line = witness.add_checkpoint(_body(leaves[:size1], leaves), NOW + 1)
    assert _cosigned_by_witness(_note(leaves), line)
    assert witness.latest(ORIGIN).size == size2  # type: ignore[union-attr]


def test_a_stale_old_size_is_refused_with_409_naming_the_cosigned_size(witness: Witness) -> None:
    leaves = _leaves(9)
    witness.add_checkpoint(_body(None, leaves[:4]), NOW)
    with pytest.raises(OldSizeConflictError) as refused:
        witness.add_checkpoint(_body(None, leaves), NOW)
    assert (refused.value.status, refused.value.latest_size) == (409, 4)
    with pytest.raises(OldSizeConflictError):
        witness.add_checkpoint(_body(leaves[:3], leaves), NOW)


def test_a_split_view_at_the_cosigned_size_is_refused_and_the_state_kept(
    witness: Witness, state_path: Path
) -> None:
    honest, forked = _leaves(6), _leaves(6, fork=" (rewritten)")
    witness.add_checkpoint(_body(None, honest), NOW)
    before = state_path.read_bytes()
    with pytest.raises(SplitViewError) as refused:
        witness.add_checkpoint(_body(honest, forked), NOW)
    assert refused.value.status == 409
    assert state_path.read_bytes() == before
    assert witness.latest(ORIGIN).root == naive_root(honest)  # type: ignore[union-attr]


def test_a_fork_that_grew_is_refused_with_422_and_the_state_kept(
    witness: Witness, state_path: Path
) -> None:
    honest = _leaves(6)
    forked = [*_leaves(6, fork=" (rewritten)"), b"entry 6"]
    witness.add_checkpoint(_body(None, honest), NOW)
    before = state_path.read_bytes()
    with pytest.raises(InconsistentCheckpointError) as refused:
        # The fork's own proof from its size 6: it does not lead from the honest root.
        witness.add_checkpoint(_body(forked[:6], forked), NOW)
    assert refused.value.status == 422
    assert state_path.read_bytes() == before


def test_a_proof_from_size_zero_must_be_empty(witness: Witness) -> None:
    tree = _leaves(4)
    body = f"old 0\n{encode_base64(naive_root(tree[:2]))}\n\n{_note(tree)}".encode()
    with pytest.raises(InconsistentCheckpointError):
        witness.add_checkpoint(body, NOW)
    assert witness.latest(ORIGIN) is None


def test_a_checkpoint_of_an_unknown_log_is_refused_with_404(witness: Witness) -> None:
    other = NoteSigner.generate("inferno.test/other")
    with pytest.raises(UnknownLogError) as refused:
        witness.add_checkpoint(_body(None, _leaves(2), _note(_leaves(2), other)), NOW)
    assert refused.value.status == 404


def test_a_checkpoint_signed_by_another_key_of_the_same_name_is_refused_with_403(
    witness: Witness,
) -> None:
    impostor = NoteSigner.generate(ORIGIN)
    with pytest.raises(UntrustedCheckpointError) as refused:
        witness.add_checkpoint(_body(None, _leaves(2), _note(_leaves(2), impostor)), NOW)
    assert refused.value.status == 403
    assert witness.latest(ORIGIN) is None


@pytest.mark.parametrize(
    "body",
    [
        b"old 3\n\n",  # no checkpoint
        b"old 01\n\n" + _note(_leaves(2)).encode(),  # a leading zero
        b"new 0\n\n" + _note(_leaves(2)).encode(),
        b"old 0\nnot base64!\n\n" + _note(_leaves(2)).encode(),
        b"old 0\n" + _note(_leaves(2)).encode(),  # no blank line before the checkpoint
        b"old 0\n\n\xff" + _note(_leaves(2)).encode(),
        b"old 0\n" + b"AAAA\n" * (MAX_PROOF_LINES + 1) + b"\n" + _note(_leaves(2)).encode(),
        b"old 0\n\n" + _note(_leaves(2)).encode() + b"x" * MAX_REQUEST_BYTES,
        b"old 3\n\n" + _note(_leaves(2)).encode(),  # old size beyond the checkpoint
    ],
    ids=["empty", "zero", "verb", "b64", "blank", "utf8", "lines", "size", "old>new"],
)
def test_a_malformed_request_is_refused_with_400(witness: Witness, body: bytes) -> None:
    with pytest.raises(WitnessRefusedError) as refused:
        witness.add_checkpoint(body, NOW)
    assert refused.value.status == 400
    assert witness.latest(ORIGIN) is None


def test_the_state_survives_a_restart_and_still_refuses_the_fork(state_path: Path) -> None:
    honest = _leaves(8)
    Witness(COSIGNER, [LOG.verifier], state_path).add_checkpoint(_body(None, honest[:5]), NOW)
    restarted = Witness(COSIGNER, [LOG.verifier], state_path)
    assert restarted.latest(ORIGIN).size == 5  # type: ignore[union-attr]
    with pytest.raises(SplitViewError):
        restarted.add_checkpoint(_body(honest[:5], _leaves(5, fork="!")), NOW)
    restarted.add_checkpoint(_body(honest[:5], honest), NOW)
    assert Witness(COSIGNER, [LOG.verifier], state_path).latest(ORIGIN).size == 8  # type: ignore[union-attr]


def test_a_state_file_edited_to_another_root_stops_the_witness(state_path: Path) -> None:
    Witness(COSIGNER, [LOG.verifier], state_path).add_checkpoint(_body(None, _leaves(3)), NOW)
    state = json.loads(state_path.read_text())
    forged = _note(_leaves(3, fork="!"), NoteSigner.generate(ORIGIN))
    state["logs"][ORIGIN] = forged
    state_path.write_text(json.dumps(state))
    with pytest.raises(WitnessStateError, match="not signed by its key"):
        Witness(COSIGNER, [LOG.verifier], state_path)


def test_a_state_file_that_is_not_json_stops_the_witness(state_path: Path) -> None:
    state_path.write_text("[" * 100_000)
    with pytest.raises(WitnessStateError, match="unusable"):
        Witness(COSIGNER, [LOG.verifier], state_path)


def test_a_refused_fork_is_kept_as_evidence_that_the_log_signed_two_trees(
    witness: Witness, state_path: Path
) -> None:
    honest, forked = _leaves(6), _leaves(6, fork=" (rewritten)")
    witness.add_checkpoint(_body(None, honest), NOW)
    with pytest.raises(SplitViewError):
        witness.add_checkpoint(_body(honest, forked), NOW)
    [kept] = (state_path.parent / (state_path.name + ".evidence")).iterdir()
    evidence = AddCheckpointRequest.parse(kept.read_bytes())
    cosigned = json.loads(state_path.read_text())["logs"][ORIGIN]
    # Both are checkpoints of size 6 signed by the log's key, with different roots.
    assert open_checkpoint(evidence.note_text, LOG.verifier) == Checkpoint(
        ORIGIN, 6, naive_root(forked)
    )
    assert open_checkpoint(cosigned, LOG.verifier) == Checkpoint(ORIGIN, 6, naive_root(honest))


def test_a_stale_size_or_a_forged_signature_leaves_no_evidence(
    witness: Witness, state_path: Path
) -> None:
    witness.add_checkpoint(_body(None, _leaves(3)), NOW)
    with pytest.raises(OldSizeConflictError):
        witness.add_checkpoint(_body(None, _leaves(4)), NOW)
    impostor = NoteSigner.generate(ORIGIN)
    with pytest.raises(UntrustedCheckpointError):
        witness.add_checkpoint(_body(_leaves(3), _leaves(5), _note(_leaves(5), impostor)), NOW)
    assert not (state_path.parent / (state_path.name + ".evidence")).exists()
