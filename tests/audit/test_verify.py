"""The offline verifier on real exports: an honest bundle passes, and every tampering is caught
with a precise message (the tamper suite), through `python -m audit verify`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from audit.__main__ import main
from audit.bundle import CHECKPOINTS, ENTRIES, MANIFEST
from audit.bundle_json import (
    MAX_CHECKPOINT_BYTES,
    MAX_ENTRY_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_STATE_BYTES,
)
from audit.canonical import canonicalize
from audit.checkpoint import Checkpoint, open_checkpoint
from audit.encoding import decode_base64, encode_base64
from audit.event import Action, Outcome, system_event
from audit.export import ExportRequest, export_bundle
from audit.log import SIGNING_KEY_FILE, AuditLog, AuditLogSettings
from audit.merkle import hash_leaf, root_of
from audit.note import NoteSigner, VerifierKey
from audit.policy import CheckpointPolicy

REPO_ROOT = Path(__file__).resolve().parents[2]


class Exported:
    """A real log of 23 events checkpointed every 5 entries, exported whole."""

    def __init__(self, root: Path, db_url: str) -> None:
        self.settings = AuditLogSettings(
            origin="inferno.test/tamper",
            database_url=db_url,
            key_dir=root / "keys",
            policy=CheckpointPolicy(every_entries=5, every_s=3600),
        )
        self.root = root
        with AuditLog.open(self.settings) as log:
            for i in range(23):
                log.append(
                    system_event(
                        Action.BOOT_PHASE,
                        time=datetime.now(UTC),
                        outcome=Outcome.SUCCESS,
                        details={"phase": f"step-{i}"},
                    )
                )
                if i % 5 == 4:  # let the writer sign the checkpoint of each five
                    log.checkpoint()
            self.vkey = log.vkey
            self.bundle = root / "bundle"
            self.summary = export_bundle(log, self.bundle, ExportRequest())
            self.log_size = log.store.size()

    def copy(self, name: str) -> Path:
        target = self.root / name
        shutil.copytree(self.bundle, target)
        return target

    def signer(self) -> NoteSigner:
        return NoteSigner.from_skey((self.settings.key_dir / SIGNING_KEY_FILE).read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("tamper")
    return Exported(root, f"sqlite:///{root / 'audit.db'}")


def _lines(bundle: Path) -> list[bytes]:
    return (bundle / ENTRIES).read_bytes().splitlines()


def _write_lines(bundle: Path, lines: list[bytes]) -> None:
    (bundle / ENTRIES).write_bytes(b"".join(line + b"\n" for line in lines))


def _edit_entry(line: bytes, change: Callable[[dict[str, Any]], object]) -> bytes:
    entry = json.loads(line)
    change(entry)
    return canonicalize(entry)


def _resign(bundle: Path, signer: NoteSigner) -> None:
    """What an operator holding the log's key could do: re-sign every checkpoint for the
    (rewritten) entries in the bundle."""
    leaf_hashes = [hash_leaf(line) for line in _lines(bundle)]
    for path in (bundle / CHECKPOINTS).iterdir():
        size = int(path.stem)
        checkpoint = Checkpoint(signer.name, size, root_of(leaf_hashes[:size]))
        path.write_text(checkpoint.sign(signer))


def _verify(bundle: Path, vkey: str, *extra: str) -> tuple[int, str, str]:
    args = ["verify", str(bundle), "--vkey", vkey, *extra]
    result = subprocess.run(
        [sys.executable, "-m", "audit", *args], capture_output=True, text=True, cwd=REPO_ROOT
    )
    return result.returncode, result.stdout, result.stderr


def test_honest_export_passes_and_records_state(exported: Exported, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    code, out, err = _verify(exported.bundle, exported.vkey, "--state", str(state))
    assert code == 0, err
    assert f"entries:     0 to {exported.log_size - 1}" in out
    assert "OK: every check passed" in out
    assert json.loads(state.read_text())["size"] == exported.log_size


def test_honest_export_as_tar_passes(exported: Exported) -> None:
    tar_path = exported.root / "bundle.tar"
    if not tar_path.exists():
        with tarfile.open(tar_path, "w") as tar:
            for path in sorted(exported.bundle.rglob("*")):
                tar.add(path, arcname=path.relative_to(exported.bundle), recursive=False)
    assert main(["verify", str(tar_path), "--vkey", exported.vkey]) == 0


def test_modified_entry_fails_the_root_at_the_next_checkpoint(exported: Exported) -> None:
    bundle = exported.copy("modified")
    lines = _lines(bundle)
    lines[7] = _edit_entry(lines[7], lambda e: e["details"].update(phase="step-x"))
    _write_lines(bundle, lines)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "FAILED: root mismatch at checkpoints/10.txt" in err


def test_deleted_entry_is_named_by_its_position(exported: Exported) -> None:
    bundle = exported.copy("deleted")
    lines = _lines(bundle)
    del lines[7]
    _write_lines(bundle, lines)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "entries.jsonl line 8 (entry 7) claims index 8: entries were inserted, deleted" in err


def test_deleted_entry_with_renumbered_successors_fails_the_root(exported: Exported) -> None:
    bundle = exported.copy("deleted-renumbered")
    lines = _lines(bundle)
    del lines[7]
    for i in range(7, len(lines)):
        lines[i] = _edit_entry(lines[i], lambda e, i=i: e.update(index=i))
    _write_lines(bundle, lines)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "root mismatch at checkpoints/10.txt" in err


def test_inserted_entry_is_caught(exported: Exported) -> None:
    bundle = exported.copy("inserted")
    lines = _lines(bundle)
    lines.insert(3, _edit_entry(lines[3], lambda e: e["details"].update(phase="forged")))
    _write_lines(bundle, lines)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "line 5 (entry 4) claims index 3" in err


def test_swapped_entries_are_caught_even_with_swapped_indices(exported: Exported) -> None:
    bundle = exported.copy("swapped")
    lines = _lines(bundle)
    a = _edit_entry(lines[3], lambda e: e.update(index=4))
    b = _edit_entry(lines[4], lambda e: e.update(index=3))
    lines[3], lines[4] = b, a
    _write_lines(bundle, lines)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "root mismatch at checkpoints/5.txt" in err


def test_truncated_entries_with_the_newer_checkpoints_kept_are_caught(exported: Exported) -> None:
    bundle = exported.copy("truncated-keep")
    _write_lines(bundle, _lines(bundle)[:12])
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert (
        "truncation: checkpoints/15.txt signs 15 entries but the bundle holds entries only "
        "up to index 11" in err
    )


def _truncate_cleanly(exported: Exported, name: str, size: int) -> Path:
    """Truncate to `size` entries and remove every trace of the newer ones."""
    bundle = exported.copy(name)
    _write_lines(bundle, _lines(bundle)[:size])
    for path in (bundle / CHECKPOINTS).iterdir():
        if int(path.stem) > size:
            path.unlink()
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["num_entries"] = size
    manifest["checkpoint_sizes"] = [s for s in manifest["checkpoint_sizes"] if s <= size]
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    return bundle


def test_clean_truncation_is_caught_with_state(exported: Exported, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    assert _verify(exported.bundle, exported.vkey, "--state", str(state))[0] == 0
    bundle = _truncate_cleanly(exported, "truncated-clean", 10)
    assert _verify(bundle, exported.vkey)[0] == 0  # alone it is a valid, older log
    code, _, err = _verify(bundle, exported.vkey, "--state", str(state))
    assert code == 1
    assert f"truncated history: size {exported.log_size} was verified before" in err


def test_history_rewritten_and_resigned_with_the_log_key_is_caught_with_state(
    exported: Exported, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    assert _verify(exported.bundle, exported.vkey, "--state", str(state))[0] == 0
    bundle = exported.copy("resigned")
    lines = _lines(bundle)
    lines[2] = _edit_entry(lines[2], lambda e: e["details"].update(phase="rewritten"))
    _write_lines(bundle, lines)
    _resign(bundle, exported.signer())
    assert _verify(bundle, exported.vkey)[0] == 0  # every signature and root is consistent
    code, _, err = _verify(bundle, exported.vkey, "--state", str(state))
    assert code == 1
    assert (
        f"equivocation: checkpoints/{exported.log_size}.txt and the state file give different "
        f"roots for tree size {exported.log_size}"
    ) in err


def test_rewritten_history_below_a_state_size_without_checkpoint_is_caught(
    exported: Exported, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    signed_root = root_of(hash_leaf(line) for line in _lines(exported.bundle)[:12])
    state.write_text(json.dumps({
        "format": "inferno-audit-state/1", "origin": "inferno.test/tamper", "size": 12,
        "root": encode_base64(signed_root), "verified_at": "x",
    }))  # fmt: skip
    bundle = exported.copy("rewritten-12")
    lines = _lines(bundle)
    lines[0] = _edit_entry(lines[0], lambda e: e["details"].update(phase="rewritten"))
    _write_lines(bundle, lines)
    _resign(bundle, exported.signer())
    code, _, err = _verify(bundle, exported.vkey, "--state", str(state))
    assert code == 1
    assert "history rewritten: the first 12 entries now hash to" in err


def test_one_flipped_signature_bit_is_caught(exported: Exported) -> None:
    bundle = exported.copy("flipped")
    path = bundle / CHECKPOINTS / "10.txt"
    text, _, signature_line = path.read_text().rpartition("\n\u2014 ")
    name, _, encoded = signature_line.strip().partition(" ")
    blob = bytearray(decode_base64(encoded, "signature"))
    blob[20] ^= 0x01
    path.write_text(f"{text}\n\u2014 {name} {encode_base64(bytes(blob))}\n")
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "checkpoints/10.txt: the signature by inferno.test/tamper+" in err
    assert "does not verify" in err


def test_checkpoints_signed_by_another_key_are_refused(exported: Exported) -> None:
    other = NoteSigner.generate("inferno.test/tamper")
    bundle = exported.copy("other-key")
    _resign(bundle, other)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "not signed by the pinned key" in err


def test_two_signed_roots_for_one_size_are_equivocation(exported: Exported) -> None:
    bundle = exported.copy("equivocation")
    forged = Checkpoint("inferno.test/tamper", 10, bytes(32)).sign(exported.signer())
    (bundle / CHECKPOINTS / "10-fork.txt").write_text(forged)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "equivocation:" in err
    assert "different roots for tree size 10" in err


def test_entries_beyond_the_last_checkpoint_are_unsigned(exported: Exported) -> None:
    bundle = exported.copy("unsigned")
    lines = _lines(bundle)
    extra = _edit_entry(lines[-1], lambda e: e.update(index=len(lines)))
    _write_lines(bundle, [*lines, extra])
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert f"unsigned entries: entries {len(lines)} to {len(lines)}" in err


def test_a_missing_checkpoint_listed_in_the_manifest_is_caught(exported: Exported) -> None:
    bundle = exported.copy("missing-checkpoint")
    (bundle / CHECKPOINTS / "15.txt").unlink()
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "(checkpoints/15.txt is missing)" in err


def test_an_entry_edited_out_of_canonical_form_is_caught(exported: Exported) -> None:
    bundle = exported.copy("noncanonical")
    lines = _lines(bundle)
    lines[1] = json.dumps(json.loads(lines[1])).encode()  # same data, with spaces
    _write_lines(bundle, lines)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 1
    assert "line 2 (entry 1) is not in RFC 8785 canonical form" in err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: (b / MANIFEST).unlink(), "is not an audit bundle: it has no manifest.json"),
        (lambda b: (b / MANIFEST).write_text("{"), "manifest.json is not valid JSON"),
        (
            lambda b: (b / CHECKPOINTS / "5.txt").write_text("garbage\n"),
            "5.txt is not a well-formed",
        ),
        (lambda b: (b / ENTRIES).write_bytes(b"{not json\n"), "line 1 (entry 0) is not valid JSON"),
    ],
)
def test_unusable_input_exits_2_with_the_reason(
    exported: Exported, tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(exported.bundle, bundle)
    damage(bundle)
    code, _, err = _verify(bundle, exported.vkey)
    assert code == 2
    assert message in err


def test_a_malformed_vkey_exits_2(exported: Exported) -> None:
    code, _, err = _verify(exported.bundle, "inferno.test/tamper+zz+AAAA")
    assert code == 2
    assert "error: verifier key key id 'zz'" in err


def test_incremental_export_continues_the_verified_state(tmp_path: Path) -> None:
    settings = AuditLogSettings(
        origin="inferno.test/incremental",
        database_url=f"sqlite:///{tmp_path / 'audit.db'}",
        key_dir=tmp_path / "keys",
        policy=CheckpointPolicy(every_entries=4, every_s=3600),
    )
    state = tmp_path / "state.json"
    event = system_event(
        Action.BOOT_PHASE, time=datetime.now(UTC), outcome=Outcome.SUCCESS, details={}
    )
    with AuditLog.open(settings) as log:
        for _ in range(9):
            log.append(event)
        first = export_bundle(log, tmp_path / "first", ExportRequest())
        assert main(["verify", str(first.path), "--vkey", log.vkey, "--state", str(state)]) == 0
        verified = json.loads(state.read_text())["size"]
        for _ in range(6):
            log.append(event)
        second = export_bundle(
            log, tmp_path / "second.tar", ExportRequest(first_index=verified), as_tar=True
        )
        assert second.first_index == verified
        assert main(["verify", str(second.path), "--vkey", log.vkey, "--state", str(state)]) == 0
        assert json.loads(state.read_text())["size"] == log.store.size()
        # An export starting after the verified size cannot prove continuity.
        for _ in range(4):
            log.append(event)
        verified = json.loads(state.read_text())["size"]
        later = export_bundle(log, tmp_path / "later", ExportRequest(first_index=verified + 2))
        assert main(["verify", str(later.path), "--vkey", log.vkey, "--state", str(state)]) == 1


def test_partial_export_with_a_forged_prefix_fails_the_root(tmp_path: Path) -> None:
    settings = AuditLogSettings(
        origin="inferno.test/prefix",
        database_url=f"sqlite:///{tmp_path / 'audit.db'}",
        key_dir=tmp_path / "keys",
    )
    event = system_event(
        Action.BOOT_PHASE, time=datetime.now(UTC), outcome=Outcome.SUCCESS, details={}
    )
    with AuditLog.open(settings) as log:
        for _ in range(11):
            log.append(event)
        summary = export_bundle(log, tmp_path / "part", ExportRequest(first_index=6, last_index=8))
        vkey = log.vkey
    assert main(["verify", str(summary.path), "--vkey", vkey]) == 0
    manifest = json.loads((summary.path / MANIFEST).read_text())
    manifest["prefix"][0] = manifest["prefix"][1]
    (summary.path / MANIFEST).write_text(json.dumps(manifest))
    assert main(["verify", str(summary.path), "--vkey", vkey]) == 1


def test_time_range_export_holds_the_entries_of_that_time(
    db_url: str, tmp_path: Path, origin: str
) -> None:
    settings = AuditLogSettings(origin=origin, database_url=db_url, key_dir=tmp_path / "keys")
    with AuditLog.open(settings) as log:
        for hour in range(6):
            log.append(system_event(
                Action.BOOT_PHASE, time=datetime(2025, 1, 1, hour, tzinfo=UTC),
                outcome=Outcome.SUCCESS, details={"hour": hour},
            ))  # fmt: skip
        summary = export_bundle(
            log,
            tmp_path / "hours",
            ExportRequest(
                since=datetime(2025, 1, 1, 2, tzinfo=UTC), until=datetime(2025, 1, 1, 3, tzinfo=UTC)
            ),
        )
        assert summary.first_index == 2
        assert main(["verify", str(summary.path), "--vkey", log.vkey]) == 0
        [(_, data)] = log.store.entries(summary.export_entry, summary.export_entry)
        export_entry = json.loads(data)
        vkey = VerifierKey.parse(log.vkey)
    assert export_entry["action"] == "audit.export"
    assert export_entry["details"]["request"]["since"] == "2025-01-01T02:00:00.000000Z"
    assert json.loads(_lines(summary.path)[0])["details"] == {"hour": 2}
    last = summary.checkpoint_sizes[-1]
    assert (
        open_checkpoint((summary.path / CHECKPOINTS / f"{last}.txt").read_text(), vkey).size == last
    )


DEEP = 100_000


def _deep_entry_line(bundle: Path) -> None:
    lines = _lines(bundle)
    lines[0] = b'{"details":' + b"[" * DEEP + b"]" * DEEP + b"}"
    _write_lines(bundle, lines)


def _long_entry_line(bundle: Path) -> None:
    lines = _lines(bundle)
    lines[0] = b'{"details":"' + b"x" * MAX_ENTRY_BYTES + b'"}'
    _write_lines(bundle, lines)


LIMITS: dict[str, tuple[Callable[[Path], object], str]] = {
    "manifest 100,000 levels deep": (
        lambda b: (b / MANIFEST).write_bytes(b"[" * DEEP + b"]" * DEEP),
        "manifest.json nests arrays and objects deeper than 64 levels",
    ),
    "entry line 100,000 levels deep": (
        _deep_entry_line,
        "entries.jsonl line 1 (entry 0) nests arrays and objects deeper than 64 levels",
    ),
    "manifest over its size limit": (
        lambda b: (b / MANIFEST).write_bytes(b" " * (MAX_MANIFEST_BYTES + 1)),
        "manifest.json is over the limit of 16777216 bytes",
    ),
    "entry line over its size limit": (
        _long_entry_line,
        "entries.jsonl line 1 is over the limit of 1048576 bytes for one entry",
    ),
    "checkpoint over its size limit": (
        lambda b: (b / CHECKPOINTS / "5.txt").write_bytes(b"x" * (MAX_CHECKPOINT_BYTES + 1)),
        "checkpoints/5.txt is over the limit of 65536 bytes",
    ),
}


@pytest.mark.parametrize("defect", LIMITS)
def test_input_over_a_limit_exits_2_with_one_line_and_no_traceback(
    exported: Exported, tmp_path: Path, defect: str
) -> None:
    """Issue 13, defect 2: unusable input (exit 2), not a RecursionError traceback (exit 1)."""
    damage, message = LIMITS[defect]
    bundle = tmp_path / "bundle"
    shutil.copytree(exported.bundle, bundle)
    damage(bundle)
    code, out, err = _verify(bundle, exported.vkey)
    assert (code, out) == (2, "")
    [line] = err.splitlines()
    assert line.startswith("error: ") and message in line


def test_a_state_file_100000_levels_deep_exits_2(exported: Exported, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_bytes(b"[" * DEEP + b"]" * DEEP)
    code, _, err = _verify(exported.bundle, exported.vkey, "--state", str(state))
    assert code == 2
    [line] = err.splitlines()
    assert "state file" in line and "deeper than 64 levels" in line
    state.write_bytes(b" " * (MAX_STATE_BYTES + 1))
    code, _, err = _verify(exported.bundle, exported.vkey, "--state", str(state))
    assert code == 2
    assert "is over the limit of 1048576 bytes" in err
