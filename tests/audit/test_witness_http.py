"""Witnessed checkpoints end to end: two `python -m audit witness` processes on loopback, an
appliance-side AuditLog that sends them its checkpoints, exports that carry their cosignatures
and verify with `--min-witnesses 2`, a witness that was down, a forked log refused over HTTP,
and a witness restarted on its state."""

from __future__ import annotations

import base64
import http.client
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from audit.__main__ import main
from audit.checkpoint import Checkpoint
from audit.cosignature import Cosigner, CosignerKey, verify_cosignatures
from audit.encoding import encode_base64
from audit.event import Action, Outcome, system_event
from audit.export import ExportRequest, export_bundle
from audit.log import SIGNING_KEY_FILE, AuditLog, AuditLogSettings
from audit.note import SignedNote
from audit.signer import load_note_signer, load_or_create_note_signer
from audit.witness_client import WitnessEndpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
ORIGIN = "inferno.test/witnessed-log"


@dataclass
class WitnessProcess:
    """One `python -m audit witness` on a loopback port of its choosing."""

    name: str
    key: Path
    state: Path
    log_vkey: str
    vkey: str = ""
    url: str = ""
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "audit", "witness", "--key", str(self.key),
             "--log-vkey", self.log_vkey, "--state", str(self.state),
             "--listen", "127.0.0.1:0"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.vkey = self.process.stdout.readline().removeprefix("witness ").strip()
        listening = self.process.stdout.readline()
        assert listening.startswith("listening on "), listening
        self.url = listening.removeprefix("listening on ").strip()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    @property
    def endpoint(self) -> WitnessEndpoint:
        return WitnessEndpoint(self.url, CosignerKey.parse(self.vkey))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("witnessed")


@pytest.fixture(scope="module")
def log_vkey(root: Path) -> str:
    return str(load_or_create_note_signer(root / "keys" / SIGNING_KEY_FILE, ORIGIN).verifier)


@pytest.fixture(scope="module")
def witnesses(root: Path, log_vkey: str) -> Iterator[list[WitnessProcess]]:
    started = []
    for name in ("witness.test/alpha", "witness.test/beta"):
        key = root / f"{name.rsplit('/', 1)[1]}.key"
        assert main(["witness-key", str(key), "--name", name]) == 0
        witness = WitnessProcess(name, key, key.with_suffix(".state"), log_vkey)
        witness.start()
        started.append(witness)
    yield started
    for witness in started:
        witness.stop()


def _settings(root: Path, witnesses: list[WitnessProcess], **kw: object) -> AuditLogSettings:
    return AuditLogSettings(
        origin=ORIGIN,
        database_url=f"sqlite:///{root / 'audit.db'}",
        key_dir=root / "keys",
        witnesses=tuple(w.endpoint for w in witnesses),
        witness_timeout_s=2.0,
        **kw,  # type: ignore[arg-type]
    )


def _append(log: AuditLog, n: int) -> None:
    for i in range(n):
        log.append(system_event(Action.BOOT_START, time=datetime.now(UTC),
                                outcome=Outcome.SUCCESS, details={"n": i}))  # fmt: skip


def _verify(bundle: Path, log_vkey: str, witnesses: list[WitnessProcess], k: int) -> int:
    pinned = [arg for w in witnesses for arg in ("--witness", w.vkey)]
    return main(["verify", str(bundle), "--vkey", log_vkey, *pinned, "--min-witnesses", str(k)])


def _cosigners(note: str, witnesses: list[WitnessProcess]) -> set[str]:
    keys = [CosignerKey.parse(w.vkey) for w in witnesses]
    return {c.witness.name for c in verify_cosignatures(SignedNote.parse(note), keys)}


def test_an_export_carries_both_witnesses_cosignatures_and_verifies_with_two_required(
    root: Path,
    log_vkey: str,
    witnesses: list[WitnessProcess],
    capsys: pytest.CaptureFixture[str],
) -> None:
    with AuditLog.open(_settings(root, witnesses)) as log:
        _append(log, 5)
        export_bundle(log, root / "bundle-both", ExportRequest())
    newest = max((root / "bundle-both" / "checkpoints").iterdir(), key=lambda p: int(p.stem))
    assert _cosigners(newest.read_text(), witnesses) == {w.name for w in witnesses}
    assert _verify(root / "bundle-both", log_vkey, witnesses, 2) == 0
    assert "cosigned by witness.test/alpha, witness.test/beta" in capsys.readouterr().out


def test_with_one_witness_down_two_required_fails_naming_it_and_one_passes(
    root: Path,
    log_vkey: str,
    witnesses: list[WitnessProcess],
    capsys: pytest.CaptureFixture[str],
) -> None:
    beta = witnesses[1]
    beta.stop()
    try:
        with AuditLog.open(_settings(root, witnesses)) as log:
            _append(log, 3)  # served at once, though beta does not answer
            export_bundle(log, root / "bundle-one", ExportRequest(first_index=0))
        capsys.readouterr()
        assert _verify(root / "bundle-one", log_vkey, witnesses, 2) == 1
        failure = capsys.readouterr().err
        assert "1 of the pinned witnesses, 2 are required; none from witness.test/beta" in failure
        assert _verify(root / "bundle-one", log_vkey, witnesses, 1) == 0
    finally:
        beta.start()  # on its state: it cosigned the first test's checkpoint, nothing since


def test_a_restarted_witness_catches_up_from_its_recorded_size(
    root: Path, log_vkey: str, witnesses: list[WitnessProcess]
) -> None:
    # beta was restarted on its state by the test before, which the log did not see: the log's
    # first request (from size 0) gets a 409 naming beta's size and is retried from there.
    with AuditLog.open(_settings(root, witnesses)) as log:
        _append(log, 2)
        export_bundle(log, root / "bundle-again", ExportRequest(first_index=0))
    assert _verify(root / "bundle-again", log_vkey, witnesses, 2) == 0


def _post(url: str, body: bytes) -> tuple[int, str, str]:
    request = urllib.request.Request(url + "/add-checkpoint", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers.get_content_type(), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type(), exc.read().decode()


def test_a_forked_log_is_refused_over_http_and_the_witness_state_is_unchanged(
    root: Path,
    log_vkey: str,
    witnesses: list[WitnessProcess],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    alpha = witnesses[0]
    # The operator equivocates: the same signing key over another database of the same origin,
    # whose checkpoints go to the same witness.
    fork_keys = tmp_path / "keys"
    fork_keys.mkdir(mode=0o700)
    shutil.copy2(root / "keys" / SIGNING_KEY_FILE, fork_keys / SIGNING_KEY_FILE)
    fork = AuditLogSettings(
        ORIGIN, f"sqlite:///{tmp_path / 'fork.db'}", fork_keys, witnesses=(alpha.endpoint,)
    )
    with AuditLog.open(settings=_settings(root, [])) as honest_log:
        honest = honest_log.store.latest_checkpoint()
    assert honest is not None
    status, content_type, size = _post(alpha.url, f"old 0\n\n{honest.note}".encode())
    assert (status, content_type, size) == (409, "text/x.tlog.size", f"{honest.size}\n")

    before = alpha.state.read_bytes()
    with AuditLog.open(fork) as forked_log:
        _append(forked_log, honest.size + 3)
        forked_log.checkpoint()
        assert forked_log.wait_for_witnesses(honest.size + 3)
        # The log's own client: a 409 names alpha's size, the retry's proof from it is a 422.
        assert "refused by witness witness.test/alpha as inconsistent" in caplog.text
        assert forked_log.store.latest_checkpoint().note.count("\u2014") == 1  # type: ignore[union-attr]
        same_size = Checkpoint(ORIGIN, honest.size, forked_log.store.root(honest.size))
        split = same_size.sign(load_note_signer(fork_keys / SIGNING_KEY_FILE, ORIGIN))
        grown = forked_log.store.latest_checkpoint()
        assert grown is not None
        proof = forked_log.store.consistency_proof(honest.size, grown.size)
    status, _, _ = _post(alpha.url, f"old {honest.size}\n\n{split}".encode())
    assert status == 409  # the same size, another root: a split view
    lines = "".join(encode_base64(h) + "\n" for h in proof)
    status, _, _ = _post(alpha.url, f"old {honest.size}\n{lines}\n{grown.note}".encode())
    assert status == 422  # a proof from the fork's tree, not from the cosigned one
    assert alpha.state.read_bytes() == before


def test_a_witness_refuses_a_second_process_on_its_state(witnesses: list[WitnessProcess]) -> None:
    alpha = witnesses[0]
    second = subprocess.run(
        [sys.executable, "-m", "audit", "witness", "--key", str(alpha.key),
         "--log-vkey", alpha.log_vkey, "--state", str(alpha.state), "--listen", "127.0.0.1:0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert second.returncode == 2
    assert "another witness process holds" in second.stderr


def test_a_forged_cosignature_in_a_bundle_fails_verification(
    root: Path, log_vkey: str, witnesses: list[WitnessProcess], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    bundle = tmp_path / "bundle"
    shutil.copytree(root / "bundle-both", bundle)
    newest = max((bundle / "checkpoints").iterdir(), key=lambda p: int(p.stem))
    note = newest.read_text()
    alpha_line = next(line for line in note.splitlines() if "witness.test/alpha" in line)
    blob = bytearray(base64.b64decode(alpha_line.split(" ")[2]))
    blob[-1] ^= 1
    newest.write_text(note.replace(alpha_line.split(" ")[2], base64.b64encode(blob).decode()))
    assert _verify(bundle, log_vkey, witnesses, 0) == 1
    assert "the cosignature by witness.test/alpha" in capsys.readouterr().err


def test_a_witness_that_never_answers_does_not_delay_appends(root: Path, tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        stuck = WitnessEndpoint(f"http://127.0.0.1:{port}", Cosigner.generate("w.test/x").verifier)
        settings = AuditLogSettings(
            "inferno.test/stuck", f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "keys",
            witnesses=(stuck,), witness_timeout_s=0.5,
        )  # fmt: skip
        with AuditLog.open(settings) as log:
            started = time.monotonic()
            for _ in range(3):
                _append(log, 1)
                log.checkpoint()  # each one handed to the witnessing thread
            assert time.monotonic() - started < 1.2  # blocked, each would take 0.5 s or more
            latest = log.store.latest_checkpoint()
            assert latest is not None
            assert latest.note.count("\u2014") == 1  # the log's signature alone


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/add-checkpoint", {}, 405),
        ("POST", "/add-checkpoint/../x", {"Content-Length": "0"}, 404),
        ("POST", "/add-checkpoint", {"Content-Length": str(65 << 10)}, 413),
        ("POST", "/add-checkpoint", {"Content-Length": "0"}, 400),
    ],
)
def test_the_witness_edge_refuses_other_methods_paths_and_oversized_bodies(
    witnesses: list[WitnessProcess], method: str, path: str, headers: dict[str, str], status: int
) -> None:
    host, port = witnesses[0].url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        assert connection.getresponse().status == status
    finally:
        connection.close()


def test_the_vkey_command_prints_a_witness_keys_vkey_and_keys_are_never_overwritten(
    witnesses: list[WitnessProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    alpha = witnesses[0]
    capsys.readouterr()
    assert main(["vkey", str(alpha.key)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == alpha.vkey
    assert main(["witness-key", str(alpha.key), "--name", "witness.test/again"]) == 2
    assert "never overwritten" in capsys.readouterr().err
