"""`python -m audit` beyond `verify` (covered by the tamper suite), and the promise that the
offline tools need nothing but the standard library and `cryptography`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from audit.__main__ import main
from audit.cosignature import Cosigner
from audit.event import Action, Outcome, system_event
from audit.export import ExportRequest, export_bundle
from audit.keyfile import create_secret_file
from audit.log import SIGNING_KEY_FILE, AuditLog, AuditLogSettings

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[AuditLogSettings, Path, str]:
    root = tmp_path_factory.mktemp("cli")
    settings = AuditLogSettings(
        origin="inferno.test/cli", database_url=f"sqlite:///{root / 'a.db'}", key_dir=root / "k"
    )
    with AuditLog.open(settings) as log:
        receipt = log.append(
            system_event(Action.BOOT_START, time=datetime.now(UTC), outcome=Outcome.SUCCESS,
                         details={"version": "0.1.0"})
        )  # fmt: skip
        (root / "receipt.tlog-proof").write_text(log.proof(receipt.index))
        (root / "receipt.leaf").write_text(receipt.header_value().split(" ")[2])
        [(_, entry)] = log.store.entries(receipt.index, receipt.index)
        (root / "entry.json").write_bytes(entry + b"\n")
        export_bundle(log, root / "bundle", ExportRequest())
        vkey = log.vkey
    return settings, root, vkey


def test_vkey_prints_the_verifier_key_of_the_signing_key_file(
    exported_log: tuple[AuditLogSettings, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    settings, _, vkey = exported_log
    assert main(["vkey", str(settings.key_dir / SIGNING_KEY_FILE)]) == 0
    assert capsys.readouterr().out.strip() == vkey
    assert vkey.startswith("inferno.test/cli+")


def test_verify_proof_accepts_a_receipt_by_entry_bytes_or_leaf_hash(
    exported_log: tuple[AuditLogSettings, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, root, vkey = exported_log
    proof = str(root / "receipt.tlog-proof")
    assert main(["verify-proof", proof, "--vkey", vkey, "--entry", str(root / "entry.json")]) == 0
    leaf = (root / "receipt.leaf").read_text()
    assert main(["verify-proof", proof, "--vkey", vkey, "--leaf-hash", leaf]) == 0
    assert "OK: entry 0 is in inferno.test/cli at tree size 1" in capsys.readouterr().out


def test_verify_proof_rejects_another_entry(
    exported_log: tuple[AuditLogSettings, Path, str], tmp_path: Path
) -> None:
    _, root, vkey = exported_log
    other = tmp_path / "other.json"
    other.write_bytes((root / "entry.json").read_bytes().replace(b"0.1.0", b"6.6.6"))
    args = ["verify-proof", str(root / "receipt.tlog-proof"), "--vkey", vkey]
    assert main([*args, "--entry", str(other)]) == 1


def test_vkey_can_be_read_from_a_file(
    exported_log: tuple[AuditLogSettings, Path, str], tmp_path: Path
) -> None:
    _, root, vkey = exported_log
    (tmp_path / "log.vkey").write_text(vkey + "\n")
    assert main(["verify", str(root / "bundle"), "--vkey", str(tmp_path / "log.vkey")]) == 0


def test_vkey_refuses_a_key_file_readable_by_others(
    exported_log: tuple[AuditLogSettings, Path, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings, _, _ = exported_log
    loose = tmp_path / "loose.key"
    loose.write_bytes((settings.key_dir / SIGNING_KEY_FILE).read_bytes())
    os.chmod(loose, 0o644)
    assert main(["vkey", str(loose)]) == 2
    assert "has mode 0644, open to group or others: chmod 600" in capsys.readouterr().err


def test_offline_verifier_imports_only_the_standard_library_and_cryptography(
    exported_log: tuple[AuditLogSettings, Path, str],
) -> None:
    _, root, vkey = exported_log
    script = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "from audit.__main__ import main\n"
        f"code = main(['verify', {str(root / 'bundle')!r}, '--vkey', {vkey!r}])\n"
        f"code |= main(['verify-proof', {str(root / 'receipt.tlog-proof')!r}, '--vkey', "
        f"{vkey!r}, '--entry', {str(root / 'entry.json')!r}])\n"
        "top = {name.split('.')[0] for name in set(sys.modules) - before}\n"
        "foreign = top - set(sys.stdlib_module_names) - {'audit', 'cryptography'}\n"
        "print(json.dumps({'code': code, 'foreign': sorted(foreign)}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["code"] == 0
    # cryptography's own compiled bindings, and nothing else.
    assert set(outcome["foreign"]) <= {"_cffi_backend", "_openssl"}


def test_vkey_reads_a_witness_key_whose_base64_holds_a_plus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The key type sits after the name and key id; a "+" inside the base64 once sent this
    # key (about half of all witness keys) to the note-key parser, which refused it.
    cosigner = next(
        c
        for c in (Cosigner.generate("witness.test/plus") for _ in range(1000))
        if "+" in c.to_skey().split("+", 4)[4]
    )
    keyfile = tmp_path / "witness.key"
    create_secret_file(keyfile, cosigner.to_skey().encode())
    assert main(["vkey", str(keyfile)]) == 0
    assert capsys.readouterr().out.strip() == str(cosigner.verifier)
