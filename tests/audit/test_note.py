"""Signed notes, checkpoints and tlog-proofs.

The PeterNeumann key and note are the C2SP signed-note example as published with its reference
implementation, golang.org/x/mod/sumdb/note (note_test.go, BSD-3-Clause). Ed25519 is
deterministic, so signing the same text with the same key must reproduce the signature exactly.
"""

from __future__ import annotations

import pytest

from audit.checkpoint import Checkpoint, open_checkpoint
from audit.encoding import encode_base64
from audit.errors import MerkleError, NoteFormatError, SignatureError
from audit.merkle import TreeFrontier, hash_leaf, inclusion_proof_plan, resolve_plan
from audit.note import NoteSigner, SignedNote, VerifierKey, open_note
from audit.tlog_proof import TlogProof

VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
SIGNATURE = (
    "\u2014 PeterNeumann "
    "x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)
NOTE = TEXT + "\n" + SIGNATURE


def test_signed_note_example_verifies_with_its_vkey() -> None:
    assert open_note(NOTE, VerifierKey.parse(VKEY)) == TEXT


def test_signing_the_example_text_reproduces_the_published_note_byte_for_byte() -> None:
    signer = NoteSigner.from_skey(SKEY)
    assert str(signer.verifier) == VKEY
    assert signer.sign(TEXT) == NOTE
    assert signer.to_skey() == SKEY


def test_a_changed_text_fails_the_signature() -> None:
    with pytest.raises(SignatureError, match="PeterNeumann\\+c74f20a3 does not verify"):
        open_note(NOTE.replace("cryptography", "cryptographY"), VerifierKey.parse(VKEY))


def test_a_note_signed_only_by_another_key_is_refused() -> None:
    other = NoteSigner.generate("PeterNeumann")
    with pytest.raises(SignatureError, match="not signed by the pinned key"):
        open_note(other.sign(TEXT), VerifierKey.parse(VKEY))


def test_signatures_by_unknown_keys_are_ignored_beside_the_pinned_one() -> None:
    cosigned = NOTE + NoteSigner.generate("witness.example").sign(TEXT).split("\n\n")[1]
    assert len(SignedNote.parse(cosigned).signatures) == 2
    assert open_note(cosigned, VerifierKey.parse(VKEY)) == TEXT


@pytest.mark.parametrize(
    ("vkey", "message"),
    [
        ("PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW", "does not match"),
        ("PeterNeumann+c74f20a3+AhpmQcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW=", "not an Ed25519"),
        ("PeterNeumann+c74f20a3", "must be <name>"),
        ("Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW", "without spaces"),
        ("PeterNeumann+C74F20A3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW", "8 lowercase hex"),
        ("PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10T!", "not valid base64"),
    ],
)
def test_malformed_vkeys_are_refused_with_the_reason(vkey: str, message: str) -> None:
    with pytest.raises(NoteFormatError, match=message):
        VerifierKey.parse(vkey)


@pytest.mark.parametrize(
    ("note", "message"),
    [
        (TEXT + SIGNATURE, "no blank line"),
        (TEXT + "\n- PeterNeumann abcd\n", "does not start with an em dash"),
        (TEXT.replace("\n", "\r\n") + "\n" + SIGNATURE, "control character 0x0d"),
        (NOTE.removesuffix("\n"), "must end with a newline"),
        (TEXT + "\n\u2014 PeterNeumann AAAA\n", "too short to hold a key id"),
    ],
)
def test_malformed_notes_are_refused_with_the_reason(note: str, message: str) -> None:
    with pytest.raises(NoteFormatError, match=message):
        SignedNote.parse(note)


def test_checkpoint_round_trips_and_opens_with_its_log_key() -> None:
    signer = NoteSigner.generate("inferno.example/log")
    checkpoint = Checkpoint("inferno.example/log", 20852163, bytes(range(32)))
    note = checkpoint.sign(signer)
    assert note.startswith(
        "inferno.example/log\n20852163\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n\n"
    )
    assert open_checkpoint(note, signer.verifier) == checkpoint


def test_checkpoint_of_another_origin_signed_by_the_log_key_is_refused() -> None:
    signer = NoteSigner.generate("inferno.example/log")
    note = Checkpoint("inferno.example/other", 1, bytes(32)).sign(signer)
    with pytest.raises(SignatureError, match=r"signed by the key of 'inferno\.example/log'"):
        open_checkpoint(note, signer.verifier)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("log\n012\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n", "leading zeros"),
        ("log\n12\nAAEC\n", "3 bytes, not 32"),
        ("log\n12\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\next\n", "exactly three lines"),
        ("\n12\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n", "non-empty"),
    ],
)
def test_malformed_checkpoint_text_is_refused(text: str, message: str) -> None:
    with pytest.raises(NoteFormatError, match=message):
        Checkpoint.from_text(text)


def test_tlog_proof_round_trips_and_verifies_inclusion() -> None:
    signer = NoteSigner.generate("inferno.example/log")
    leaves = [hash_leaf(bytes([i])) for i in range(6)]
    frontier, nodes = TreeFrontier(), {}
    for leaf in leaves:
        nodes.update(frontier.append(leaf))
    note = Checkpoint("inferno.example/log", 6, frontier.root()).sign(signer)
    proof = TlogProof(4, resolve_plan(inclusion_proof_plan(4, 6), nodes), note)
    text = proof.to_text()
    assert text.startswith("c2sp.org/tlog-proof@v1\nindex 4\n")
    parsed = TlogProof.from_text(text)
    assert parsed == proof
    assert parsed.verify(leaves[4], signer.verifier).size == 6
    with pytest.raises(MerkleError):
        parsed.verify(leaves[3], signer.verifier)


def test_tlog_proof_with_extra_data_parses_it() -> None:
    text = f"c2sp.org/tlog-proof@v1\nextra {encode_base64(b'ctx')}\nindex 0\n\nnote"
    assert TlogProof.from_text(text).extra == b"ctx"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("c2sp.org/tlog-proof@v2\nindex 0\n\nnote", "must start with"),
        ("c2sp.org/tlog-proof@v1\nindex 00\n\nnote", "leading zeros"),
        ("c2sp.org/tlog-proof@v1\n\nnote", "no 'index N' line"),
        ("c2sp.org/tlog-proof@v1\nindex 0\nnot-base64!\n\nnote", "hash 0 is not valid base64"),
        ("c2sp.org/tlog-proof@v1\nindex 0\n", "no blank line"),
    ],
)
def test_malformed_tlog_proofs_are_refused(text: str, message: str) -> None:
    with pytest.raises(NoteFormatError, match=message):
        TlogProof.from_text(text)
