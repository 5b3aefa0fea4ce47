"""C2SP tlog-cosignature v1 (audit.cosignature): the signed message, the key ID, the line's
layout, and what verification accepts and refuses.

The spec publishes no key with its example, so the known-answer vector below is ours: the
RFC 8032-style fixed seed bytes(range(32)), the spec's example checkpoint and time. Its parts are
checked independently of the code under test: the key ID with hashlib, the message against the
spec's literal example, the signature with `cryptography` directly, and the line's layout against
the spec's own example cosignature (whose timestamp is its example's time). Regenerate the line
with `Cosigner(NAME, Ed25519PrivateKey.from_private_bytes(SEED)).cosign(CHECKPOINT, TIME)`;
Ed25519 is deterministic, so it never changes unless the format does.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from audit.cosignature import Cosigner, CosignerKey, signed_message, verify_cosignatures
from audit.errors import NoteFormatError, SignatureError
from audit.note import NoteSigner, SignedNote

SEED = bytes(range(32))
NAME = "witness.example/w1"
TIME = 1679315147
# The spec's examples (sections "Format" and "Ed25519 signed message").
CHECKPOINT = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
SPEC_MESSAGE = (
    "cosignature/v1\ntime 1679315147\nexample.com/behind-the-sofa\n20852163\n"
    "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
)
SPEC_COSIGNATURE = (
    "jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJsX3b2oyin1nPZqhf5nNo0xUe+mbIU"
    "BkBIfZ+qnA=="
)
VKEY = "witness.example/w1+e75f6532+BAOhB7/zzhC+HXDdGOdLwJln5NYwm6UNXx3chmQSVTG4"
LINE = (
    "\u2014 witness.example/w1 519lMgAAAABkGFDLBuRDazBLVac2NE+Y+IjbjQOcXLfF9CSDZVUIoS83rE1nFZsVE8Yi"
    "WV6Ngr7lV8H6bdoBQGP/l73euDMQ9k+bBQ==\n"
)
COSIGNER = Cosigner(NAME, Ed25519PrivateKey.from_private_bytes(SEED))


def test_the_signed_message_is_the_spec_example_byte_for_byte() -> None:
    assert signed_message(CHECKPOINT, TIME) == SPEC_MESSAGE.encode()


def test_the_key_id_hashes_the_name_a_newline_0x04_and_the_key() -> None:
    public = Ed25519PrivateKey.from_private_bytes(SEED).public_key().public_bytes_raw()
    expected = hashlib.sha256(NAME.encode() + b"\n\x04" + public).digest()[:4]
    assert COSIGNER.verifier.key_id.to_bytes(4, "big") == expected
    assert str(COSIGNER.verifier) == VKEY
    assert CosignerKey.parse(VKEY) == COSIGNER.verifier
    # The same key as a note signer (type 0x01) has another ID: the two never match.
    assert NoteSigner(NAME, Ed25519PrivateKey.from_private_bytes(SEED)).verifier.key_id != (
        COSIGNER.verifier.key_id
    )


def test_the_cosignature_line_is_the_known_answer_and_verifies_independently() -> None:
    assert COSIGNER.cosign(CHECKPOINT, TIME) == LINE
    blob = base64.b64decode(LINE.split(" ")[2])
    assert blob[:4] == COSIGNER.verifier.key_id.to_bytes(4, "big")
    assert int.from_bytes(blob[4:12], "big") == TIME
    public = Ed25519PrivateKey.from_private_bytes(SEED).public_key()
    public.verify(blob[12:], SPEC_MESSAGE.encode())  # raises if it does not verify


def test_the_spec_example_cosignature_has_the_layout_we_write() -> None:
    blob = base64.b64decode(SPEC_COSIGNATURE)
    assert len(blob) == 4 + 8 + 64
    assert int.from_bytes(blob[4:12], "big") == TIME


def test_verify_returns_the_timestamp_and_ignores_other_keys() -> None:
    log = NoteSigner.generate("example.com/behind-the-sofa")
    note = SignedNote.parse(log.sign(CHECKPOINT) + LINE)
    other = Cosigner.generate("witness.example/w2").verifier
    [cosignature] = verify_cosignatures(note, [COSIGNER.verifier, other])
    assert (cosignature.witness, cosignature.timestamp) == (COSIGNER.verifier, TIME)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda text, line: (text.replace("20852163", "20852164"), line),  # another checkpoint
        lambda text, line: (text, line.replace("519lMgAAAABkGFDL", "519lMgAAAABkGFDM")),  # time
        lambda text, line: (text, line.replace("BQ==", "Bg==")),  # a flipped signature bit
    ],
    ids=["checkpoint", "timestamp", "signature"],
)
def test_a_cosignature_by_a_pinned_key_that_does_not_verify_rejects_the_note(
    tamper: Callable[[str, str], tuple[str, str]],
) -> None:
    text, line = tamper(CHECKPOINT, LINE)
    note = SignedNote.parse(text + "\n" + line)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_cosignatures(note, [COSIGNER.verifier])


def test_a_truncated_cosignature_is_refused() -> None:
    blob = base64.b64decode(LINE.split(" ")[2])
    short = f"\u2014 {NAME} {base64.b64encode(blob[:-1]).decode()}\n"
    note = SignedNote.parse(CHECKPOINT + "\n" + short)
    with pytest.raises(SignatureError, match="not 72"):
        verify_cosignatures(note, [COSIGNER.verifier])


def test_the_witness_skey_round_trips_and_a_note_key_is_not_a_witness_key() -> None:
    again = Cosigner.from_skey(COSIGNER.to_skey())
    assert again.verifier == COSIGNER.verifier
    assert again.cosign(CHECKPOINT, TIME) == LINE
    note_vkey = str(NoteSigner.generate(NAME).verifier)
    with pytest.raises(NoteFormatError, match="type 0x04"):
        CosignerKey.parse(note_vkey)
    with pytest.raises(NoteFormatError, match="type 0x04"):
        Cosigner.from_skey(NoteSigner.generate(NAME).to_skey())
