"""The `inferno` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.auth.roles import Role
from appliance.engine.errors import EngineError
from appliance.errors import ApplianceError, ConfigError
from audit.errors import AuditError
from installer.errors import InstallerError

if TYPE_CHECKING:  # the engine imports torch: only load it for commands that need it
    from appliance.config import Settings
    from appliance.engine.engine import Engine
    from appliance.engine.sampling_params import SamplingParams
    from audit.event import Actor
    from audit.log import AuditLog

_DESCRIPTION = "Inferno: a confidential LLM inference appliance."


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("INFERNO_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args) or 0)
    except (ApplianceError, AuditError, EngineError, InstallerError) as exc:
        print(f"inferno: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferno", description=_DESCRIPTION)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate one completion and print only its text")
    gen.add_argument("--model", required=True, type=Path, help="model directory")
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_sampling_args(gen)
    gen.set_defaults(run=_run_generate)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTPS API")
    serve.add_argument("--config", required=True, type=Path, help="settings file (TOML)")
    serve.set_defaults(run=_run_serve)

    demo = commands.add_parser(
        "demo",
        help="serve the embedded default model on https://127.0.0.1:8443 (converted on first use)",
    )
    demo.add_argument("--model", type=Path, default=None, help="model directory to use instead")
    demo.add_argument(
        "--device", default="cpu", help="cpu, or cuda for the GPU path (bf16, Triton kernels)"
    )
    demo.add_argument("--port", type=int, default=None, help="port to listen on (default 8443)")
    demo.set_defaults(run=_run_demo)

    audit = commands.add_parser(
        "audit", help="export the audit log, or show its verifier key (with the server's settings)"
    )
    audit_commands = audit.add_subparsers(required=True, metavar="ACTION")
    export = audit_commands.add_parser(
        "export", help="write a bundle of the log for offline verification (itself logged)"
    )
    export.add_argument("out", type=Path, help="bundle directory (or tar file) to create")
    export.add_argument("--config", required=True, type=Path, help="the server's settings file")
    export.add_argument("--from", dest="first", type=int, help="first entry (default 0)")
    export.add_argument("--to", dest="last", type=int, help="last entry (default: the newest)")
    export.add_argument("--tar", action="store_true", help="write one tar file, not a directory")
    export.set_defaults(run=_run_audit_export)
    vkey = audit_commands.add_parser(
        "vkey", help="print the verifier key that auditors pin to verify exports"
    )
    vkey.add_argument("--config", required=True, type=Path, help="the server's settings file")
    vkey.set_defaults(run=_run_audit_vkey)

    token = commands.add_parser(
        "token",
        help="print a short-lived bearer token of the local issuer (where auth.local_issuer "
        "enables it, as in the demo)",
    )
    token.add_argument("--role", required=True, choices=[role.value for role in Role])
    token.add_argument("--sub", required=True, help="the subject the token names (who uses it)")
    token.add_argument(
        "--config", type=Path, default=None, help="the server's settings file (default: the demo's)"
    )
    token.set_defaults(run=_run_token)

    model = commands.add_parser("model", help="manage model directories")
    model_commands = model.add_subparsers(required=True, metavar="ACTION")
    imp = model_commands.add_parser("import-gguf", help="convert a GGUF file to a model directory")
    imp.add_argument("gguf", type=Path, help="the .gguf file")
    imp.add_argument("outdir", type=Path, help="model directory to create")
    imp.set_defaults(run=_run_import_gguf)
    return parser


def _add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = 128) -> None:
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda for the GPU path (bf16, Triton kernels)"
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from appliance.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _load_engine(model_dir: Path, device: str) -> Engine:
    from appliance.engine.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig(model_dir=model_dir, device=device))


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _load_engine(args.model, args.device)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    [completion] = engine.generate([prompt], params)
    sys.stdout.write(completion.text)
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0


def _run_import_gguf(args: argparse.Namespace) -> int:
    from appliance.engine.models.gguf_import import import_gguf

    out = import_gguf(args.gguf, args.outdir, show_progress=sys.stderr.isatty())
    print(f"model directory written: {out}", file=sys.stderr)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from appliance.app import build
    from appliance.boot.startup import start_audit_log
    from appliance.config import load_settings
    from appliance.server import listen, serve

    settings = load_settings(args.config)
    logging.getLogger().setLevel(settings.log.level)
    # The app closes the log at its shutdown (after a SIGTERM the process ends right after);
    # closing it here as well covers a start that fails before serving.
    with start_audit_log(settings) as audit_log:
        app = build(settings, audit_log)
        listener = listen(settings)
        print(f"inferno: serving {settings.served_model_name} on {listener.url}", file=sys.stderr)
        if listener.fingerprint is not None:
            print(f"inferno: TLS certificate SHA-256 {listener.fingerprint}", file=sys.stderr)
        serve(settings, app, listener)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from appliance.app import build
    from appliance.boot.startup import engine_config, start_audit_log
    from appliance.boot.weights import LoadedModel
    from appliance.config import load_settings
    from appliance.engine.models.gguf_import import import_gguf
    from appliance.server import listen, serve
    from installer.demo import DEMO_PORT, demo_dir, write_demo_config
    from installer.embedded_model import default_model_dir, find_embedded_gguf

    model_dir = args.model or default_model_dir()
    if not (model_dir / "config.json").exists():
        print(f"converting the embedded model into {model_dir} ...", file=sys.stderr)
        import_gguf(find_embedded_gguf(), model_dir, show_progress=sys.stderr.isatty())
    port = DEMO_PORT if args.port is None else args.port
    config_path = write_demo_config(demo_dir(), model_dir, device=args.device, port=port)
    settings = load_settings(config_path)
    with start_audit_log(settings) as audit_log:
        listener = listen(settings)
        print(f"loading {settings.served_model_name} ...", file=sys.stderr)
        # Loaded before serving, so the server is ready when the banner says so.
        model = LoadedModel.load(engine_config(settings))
        app = build(settings, audit_log, model=model)
        tokens = {
            role: _mint(settings, audit_log, role, f"demo-{role}", "inferno demo")
            for role in (Role.USER, Role.ADMIN)
        }
        banner = _demo_banner(
            settings.served_model_name, listener.url, settings, config_path, audit_log.vkey, tokens
        )
        print(banner, flush=True)
        serve(settings, app, listener)
    return 0


def _mint(settings: Settings, log: AuditLog, role: Role, subject: str, command: str) -> str:
    """A local-issuer token, recorded in the audit log (`admin.token.issue`: who ran `command`,
    the role, subject, token id and expiry; never the token) before it is handed out. A token
    whose issue cannot be recorded is not printed."""
    import time
    from datetime import UTC, datetime

    import jwt

    from appliance.auth.local_issuer import LocalIssuer
    from audit.event import Outcome, admin_action

    issuer = LocalIssuer.from_settings(settings.auth)
    if issuer is None:
        raise ConfigError(
            "auth.local_issuer is off in these settings: tokens come from the identity provider"
        )
    token = issuer.mint(role, subject, time.time())
    claims = jwt.decode(token, options={"verify_signature": False})  # ours, just signed
    log.append(
        admin_action(
            time=datetime.now(UTC),
            actor=_local_operator(command),
            source_address=None,
            request_id=None,
            operation="token.issue",
            outcome=Outcome.SUCCESS,
            target={
                "issuer": claims["iss"],
                "subject": subject,
                "roles": [role.value],
                "token_id": claims["jti"],
                "expires": datetime.fromtimestamp(claims["exp"], UTC).isoformat(),
            },
        )
    )
    return token


def _run_token(args: argparse.Namespace) -> int:
    from appliance.boot.startup import open_audit_log
    from appliance.config import load_settings
    from installer.demo import CONFIG_NAME, demo_dir

    settings = load_settings(args.config or demo_dir() / CONFIG_NAME)
    with open_audit_log(settings.audit) as log:
        token = _mint(settings, log, Role(args.role), args.sub, "inferno token")
    print(token)
    return 0


def _demo_banner(
    model: str, url: str, settings: Settings, config_path: Path, vkey: str, tokens: dict[Role, str]
) -> str:
    from appliance.tls import certificate_fingerprint

    cert = settings.tls.cert_file
    fingerprint = certificate_fingerprint(cert) if cert is not None else "none"
    question = "What is the capital of France?"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}]})
    ttl_min = settings.auth.local_issuer_token_ttl_s // 60
    return f"""\
Inferno demo: {model} on {url}  (Ctrl-C stops it)
TLS certificate (self-signed): {cert}
  SHA-256 fingerprint {fingerprint}

Bearer tokens of the demo's own issuer, valid {ttl_min} minutes
(more: inferno token --role user|service|admin|auditor --sub NAME):
  user  (inference):        {tokens[Role.USER]}
  admin (status, metrics):  {tokens[Role.ADMIN]}

Call it with curl:
  curl --cacert {cert} {url}/v1/chat/completions \\
    -H 'Authorization: Bearer {tokens[Role.USER]}' \\
    -H 'Content-Type: application/json' -d '{body}'

or with OpenAI's Python client (the API key is the bearer token):
  import httpx, openai, ssl
  client = openai.OpenAI(base_url="{url}/v1", api_key="{tokens[Role.USER]}",
      http_client=httpx.Client(verify=ssl.create_default_context(cafile="{cert}")))
  reply = client.chat.completions.create(model="{model}",
      messages=[{{"role": "user", "content": "{question}"}}])
  print(reply.choices[0].message.content)

Every response names its audit log entry (Audit-Entry header; its proof: {url}/v1/audit/proof/N).
Audit log verifier key (auditors pin it to verify exports offline):
  {vkey}
Export the log: inferno audit export OUT --config {config_path}

TEE: UNVERIFIED. A demo runs with tee.mode = "insecure-dev": nothing about this machine is
attested, and every response says so (X-Inferno-TEE: UNVERIFIED).

Health: {url}/health   Metrics (admin token): {url}/metrics   Settings: {config_path}"""


def _run_audit_export(args: argparse.Namespace) -> int:
    from appliance.boot.startup import open_audit_log
    from appliance.config import load_settings
    from audit.export import ExportRequest, export_bundle

    settings = load_settings(args.config)
    request = ExportRequest(first_index=args.first, last_index=args.last)
    with open_audit_log(settings.audit) as log:
        summary = export_bundle(
            log, args.out, request, actor=_local_operator("inferno audit export"), as_tar=args.tar
        )
    last = summary.first_index + summary.num_entries - 1
    sizes = ", ".join(map(str, summary.checkpoint_sizes))
    print(
        f"exported entries {summary.first_index} to {last} of {settings.audit.origin} to "
        f"{summary.path} (signed checkpoints at sizes {sizes}; this export is entry "
        f"{summary.export_entry})\n"
        f"verify it offline: python -m audit verify {summary.path} --vkey VKEY "
        "(`inferno audit vkey` prints the VKEY to pin)"
    )
    return 0


def _run_audit_vkey(args: argparse.Namespace) -> int:
    from appliance.config import load_settings
    from audit.log import SIGNING_KEY_FILE
    from audit.signer import load_note_signer

    audit = load_settings(args.config).audit
    print(load_note_signer(audit.effective_key_dir / SIGNING_KEY_FILE, audit.origin).verifier)
    return 0


def _local_operator(command: str) -> Actor:
    """Who runs an `inferno` command on the appliance itself: the operating system's user."""
    import pwd

    from audit.event import Actor

    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"uid {uid}"
    return Actor(issuer="local", subject=name, client=command)


if __name__ == "__main__":
    sys.exit(main())
