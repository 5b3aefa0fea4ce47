"""The demo's files: where they live and the settings file `inferno demo` serves with.

Everything sits under `$XDG_DATA_HOME/inferno/demo` (default `~/.local/share/...`): the
settings file, rewritten at every start; the self-signed TLS certificate and key, made at the
first start and kept (so a client that pinned the certificate keeps trusting it); and the audit
log (`audit/`: its SQLite database and keys, kept from start to start, as is its vkey); and
the local token issuer's key (`auth/`), also kept, so tokens printed earlier stay valid.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEMO_HOST = "127.0.0.1"
DEMO_PORT = 8443
DEMO_AUDIT_ORIGIN = "inferno-demo.localhost/audit"
CONFIG_NAME = "inferno.toml"


def demo_dir() -> Path:
    """`$XDG_DATA_HOME/inferno/demo`; reads the environment when called, creates nothing."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "inferno" / "demo"


def write_demo_config(directory: Path, model_dir: Path, *, device: str, port: int) -> Path:
    """Write the demo's settings file into `directory` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CONFIG_NAME
    # TOML basic strings take JSON's escapes, so json.dumps quotes any path correctly.
    path.write_text(
        "# Written by `inferno demo` at every start: edit a copy and run\n"
        "# `inferno serve --config COPY`. Every setting is described in docs/CONFIG.md.\n"
        "\n"
        "[model]\n"
        f"dir = {json.dumps(str(model_dir.resolve()))}\n"
        "\n"
        "[engine]\n"
        f"device = {json.dumps(device)}\n"
        "\n"
        "[server]\n"
        f"host = {json.dumps(DEMO_HOST)}\n"
        f"port = {port}\n"
        "\n"
        "[tls]\n"
        "# Made at the first start, then kept.\n"
        'cert_file = "tls/cert.pem"\n'
        'key_file = "tls/key.pem"\n'
        "self_signed = true\n"
        "\n"
        "[audit]\n"
        f"origin = {json.dumps(DEMO_AUDIT_ORIGIN)}\n"
        "# The SQLite database and the keys, kept from start to start.\n"
        'data_dir = "audit"\n'
        "\n"
        "[appliance]\n"
        "# A demo: the insecure settings below are allowed, and shown as such.\n"
        'profile = "development"\n'
        "\n"
        "[tee]\n"
        "# Nothing is attested: every response carries X-Inferno-TEE: UNVERIFIED.\n"
        'mode = "insecure-dev"\n'
        "\n"
        "[auth]\n"
        "# No identity provider: the appliance's own issuer signs the tokens that\n"
        "# `inferno token --role ROLE --sub NAME` prints. Its key is made at the first start.\n"
        'local_issuer = "demo"\n'
        'local_issuer_key_file = "auth/local-issuer.pem"\n',
        encoding="utf-8",
    )
    return path
