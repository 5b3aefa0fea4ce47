"""Kill -9 of a process logging under concurrent load: after restart every request that got its
response has both entries, and the log still verifies (on SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from audit.__main__ import main as audit_cli
from audit.export import ExportRequest, export_bundle
from audit.log import AuditLog, AuditLogSettings

WRITER = Path(__file__).with_name("crash_writer.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kill_9_under_load_loses_no_answered_request(
    db_url: str, origin: str, tmp_path: Path
) -> None:
    key_dir = tmp_path / "keys"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    writer = subprocess.Popen(
        [sys.executable, str(WRITER), db_url, str(key_dir), origin],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    responded: list[tuple[str, int, int]] = []
    deadline = time.monotonic() + 60
    assert writer.stdout is not None
    while len(responded) < 300:
        line = writer.stdout.readline()
        assert line, f"writer exited early: {writer.stderr.read() if writer.stderr else ''}"
        assert time.monotonic() < deadline, "the writer is too slow"
        _, request_id, first, second = line.split()
        responded.append((request_id, int(first), int(second)))
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    responded += [  # answers already written to the pipe before the kill
        (r, int(a), int(b)) for _, r, a, b in (x.split() for x in writer.stdout.read().splitlines())
    ]

    with AuditLog.open(AuditLogSettings(origin, db_url, key_dir)) as log:
        size = log.store.size()
        stored = {index: json.loads(data) for index, data in log.store.entries(0, size - 1)}
        for request_id, first, second in responded:
            assert stored[first]["request_id"] == request_id
            assert stored[first]["action"] == "inference.request"
            assert stored[second]["request_id"] == request_id
            assert stored[second]["action"] == "inference.complete"
        bundle = export_bundle(log, tmp_path / "bundle", ExportRequest())
        vkey = log.vkey
    assert audit_cli(["verify", str(bundle.path), "--vkey", vkey]) == 0
