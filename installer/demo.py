"""The demo's files: where they live, the settings file `inferno demo` serves with, the file of
its tokens, and the banner that says how to call it.

Everything sits under `$XDG_DATA_HOME/inferno/demo` (default `~/.local/share/...`): the
settings file, rewritten at every start that gets as far as listening; the self-signed TLS
certificate and key, made at the first start and kept (so a client that pinned the certificate
keeps trusting it); the audit log (`audit/`: its SQLite database and keys, kept from start to
start, as is its vkey); the local token issuer's key (`auth/`), also kept, so tokens handed out
earlier stay valid; and the tokens of the latest start (`tokens.env`, owner-only).
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEMO_HOST = "127.0.0.1"
DEMO_PORT = 8443
DEMO_AUDIT_ORIGIN = "inferno-demo.localhost/audit"
CONFIG_NAME = "inferno.toml"
TOKENS_NAME = "tokens.env"
# The variables of the tokens file, by role; the banner's commands read them.
TOKEN_VARIABLES = {"user": "INFERNO_USER_TOKEN", "admin": "INFERNO_ADMIN_TOKEN"}
DEMO_QUESTION = "What is the capital of France?"
# A bound on the banner's examples: a small model can ramble for
# thousands of tokens, minutes on a CPU.
DEMO_MAX_TOKENS = 64
# Greedy: for the banner's question the 135M model's first token is nearly a tie between
# "The" (… Paris.) and "L" (L'Étoile …, then nonsense), so any sampling, even at the model
# card's 0.2, answers nonsense about half the time; greedy answers "The capital of France is
# Paris." The banner also shows where sampling settings go.
DEMO_TEMPERATURE = 0


def demo_dir() -> Path:
    """`$XDG_DATA_HOME/inferno/demo`; reads the environment when called, creates nothing."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "inferno" / "demo"


def stage_demo_config(directory: Path, model_dir: Path, *, device: str, port: int) -> Path:
    """Write the demo's settings into a new file beside `directory/inferno.toml` and return its
    path: relative paths in it mean the same as in the real one. `commit_demo_config` moves it
    into place once the demo can serve; until then the file of a demo already running stays as
    it is (a second demo that cannot listen must not rewrite the first one's settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{CONFIG_NAME}.", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(_config_text(model_dir, device=device, port=port))
    return Path(name)


def commit_demo_config(staged: Path) -> Path:
    """Rename the staged settings file over the demo's settings file (atomically); its path."""
    path = staged.parent / CONFIG_NAME
    os.replace(staged, path)
    return path


def _config_text(model_dir: Path, *, device: str, port: int) -> str:
    # TOML basic strings take JSON's escapes, so json.dumps quotes any path correctly.
    return (
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
        'local_issuer_key_file = "auth/local-issuer.pem"\n'
    )


def write_tokens_file(directory: Path, tokens: dict[str, str], *, expires: str) -> Path:
    """Write `tokens` (role -> bearer token) to `directory/tokens.env` as shell `export` lines
    (`. FILE` loads them), readable by its owner only from the first byte, and renamed into
    place so that a reader never sees half a file. Returns its path."""
    path = directory / TOKENS_NAME
    lines = [
        f"# Bearer tokens of the demo's own issuer, valid until {expires}.",
        f"# Load them into a shell: . {shlex.quote(str(path))}",
    ]
    lines += [f"export {TOKEN_VARIABLES[role]}={token}" for role, token in tokens.items()]
    fd, name = tempfile.mkstemp(prefix=f".{TOKENS_NAME}.", dir=directory)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write("\n".join(lines) + "\n")
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True, slots=True)
class DemoBanner:
    """What the demo prints once it serves: where, the certificate to trust, where the tokens
    are, and one command each for curl and OpenAI's Python client, both ready to paste once
    the tokens file is loaded."""

    model: str
    url: str
    cert_file: Path
    fingerprint: str
    tokens_file: Path
    token_ttl_s: int
    # The demo's own interpreter: the environment that has OpenAI's client (the demo extra).
    python: str

    def curl_command(self) -> str:
        messages = [{"role": "user", "content": DEMO_QUESTION}]
        body = json.dumps(
            {"model": self.model, "messages": messages, "max_tokens": DEMO_MAX_TOKENS,
             "temperature": DEMO_TEMPERATURE}
        )  # fmt: skip
        return (
            f"curl --cacert {shlex.quote(str(self.cert_file))} {self.url}/v1/chat/completions "
            f'-H "Authorization: Bearer ${TOKEN_VARIABLES["user"]}" '
            f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
        )

    def openai_command(self) -> str:
        messages = [{"role": "user", "content": DEMO_QUESTION}]
        program = (
            "import os, openai; "
            f"client = openai.OpenAI(base_url={json.dumps(self.url + '/v1')}, "
            f"api_key=os.environ[{json.dumps(TOKEN_VARIABLES['user'])}]); "
            f"reply = client.chat.completions.create(model={json.dumps(self.model)}, "
            f"messages={json.dumps(messages)}, max_tokens={DEMO_MAX_TOKENS}, "
            f"temperature={DEMO_TEMPERATURE}); "
            "print(reply.choices[0].message.content)"
        )
        # httpx, under OpenAI's client, trusts the certificate that SSL_CERT_FILE names.
        return (
            f"SSL_CERT_FILE={shlex.quote(str(self.cert_file))} "
            f"{shlex.quote(self.python)} -c {shlex.quote(program)}"
        )

    def text(self) -> str:
        tokens = shlex.quote(str(self.tokens_file))
        return (
            f"Inferno demo: {self.model} on {self.url}  (Ctrl-C stops it)\n"
            f"TLS certificate (self-signed): {self.cert_file}\n"
            f"  SHA-256 fingerprint {self.fingerprint}\n"
            f"Tokens (user, admin; valid {self.token_ttl_s // 60} min): {self.tokens_file}"
            " (owner-only)\n"
            f"  load them: . {tokens}   more: inferno token --role ROLE --sub NAME\n"
            f"Console: {self.url}/console/  (sign in: inferno console-link)\n"
            'TEE: UNVERIFIED (tee.mode = "insecure-dev": nothing is attested, and every '
            "response says so)\n"
            "\n"
            f"  {self.curl_command()}\n"
            f"  {self.openai_command()}"
        )
