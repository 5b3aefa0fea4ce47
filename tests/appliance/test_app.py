"""The composition root (appliance.app): what building the app imports. Everything a start
imports before its first token is on W5's path (docs/BENCHMARKS.md), so clients only some
requests need are left to those requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.appliance.engine.test_warmup import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[2]

# What `inferno serve` imports and builds before it listens, for settings whose tokens come
# from the local issuer alone; then which of the identity providers' clients were imported.
_BUILD_THE_APP = """
import sys
from pathlib import Path
import appliance.__main__, appliance.server
from appliance.app import build
from appliance.boot.startup import start_audit_log
from appliance.config import settings_from_mapping

work = Path(sys.argv[1])
settings = settings_from_mapping(
    {
        "model": {"dir": str(work / "model")},
        "server": {"host": "127.0.0.1", "port": 0},
        "tls": {"cert_file": str(work / "cert.pem"), "key_file": str(work / "key.pem"),
                "self_signed": True},
        "audit": {"origin": "test.example/audit", "data_dir": str(work / "audit")},
        "appliance": {"profile": "development"},
        "tee": {"mode": "insecure-dev"},
        "auth": {"local_issuer": "demo", "local_issuer_key_file": str(work / "issuer.pem")},
    },
    base_dir=work,
)
with start_audit_log(settings) as audit_log:
    build(settings, audit_log)
print(sorted(m for m in ("authlib", "httpx") if m in sys.modules))
"""


def test_building_the_app_imports_no_identity_provider_client(tmp_path: Path) -> None:
    """httpx (with its command line's rich and pygments) and authlib cost a start 0.1 s of
    imports; the app imports them only when it first talks to an identity provider or a
    console login begins (appliance.auth.idp_http, appliance.auth.oidc_login)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_THE_APP, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
