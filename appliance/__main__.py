"""The `inferno` command."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import lifecycle
from appliance.auth.roles import Role
from appliance.engine.errors import EngineError
from appliance.errors import ApplianceError, ConfigError
from appliance.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from appliance.settings_file import add_config_arg, settings_file
from audit.errors import AuditError
from installer.demo import DEMO_PORT
from installer.errors import InstallerError

if TYPE_CHECKING:  # the engine imports torch: only load it for commands that need it
    from appliance.auth.local_issuer import LocalIssuer
    from appliance.config import Settings
    from appliance.engine.engine import Engine
    from appliance.engine.sampling_params import SamplingParams
    from audit.event import Actor
    from audit.log import AuditLog

_DESCRIPTION = "Inferno: a confidential LLM inference appliance."
# What a process killed by SIGPIPE returns in a shell (128 + 13).
_BROKEN_PIPE_STATUS = 141

# The command's own progress lines ("converting ...", "loading ..."): shown at any log level.
_log = logging.getLogger("inferno")


# torch's CUDA allocator in expandable segments unless the operator configured it: with fixed
# segments, the varying transients of mixed prefill steps left 4.3 GB cached but unusable on
# the H100 (W2), which also made those steps slower; expandable, W6 is 1.5 GiB
# (docs/BENCHMARKS.md). Read when CUDA first allocates, after this.
_CUDA_ALLOC_CONF = "expandable_segments:True"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", _CUDA_ALLOC_CONF)
    with _quiet_when_stdout_closes():
        args = _parser().parse_args(argv)
        try:
            args.log_level, args.log_format = _log_options(args)
            configure_logging(args.log_level, args.log_format)
            return int(args.run(args) or 0)
        except (ApplianceError, AuditError, EngineError, InstallerError) as exc:
            if getattr(args, "log_format", None) == "json":
                _log.error("%s", exc)  # a log shipper reads the reason like any other line
            else:
                print(f"inferno: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130


@contextlib.contextmanager
def _quiet_when_stdout_closes() -> Iterator[None]:
    """End quietly when whoever reads stdout stops (`inferno ... | head`), as the Python
    documentation advises (library/signal.html, "Note on SIGPIPE"): stdout is flushed here, so
    that a closed pipe shows up here rather than as a traceback at exit; then it is pointed at
    /dev/null, so that the interpreter's last flush cannot fail again."""
    try:
        try:
            yield
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(_BROKEN_PIPE_STATUS)


def _log_options(args: argparse.Namespace) -> tuple[str, str]:
    """The log level and format before any settings file is read: `--log-format`, else the
    `INFERNO_LOG_*` variables (which also override the settings file's `[log]`)."""
    level = os.environ.get("INFERNO_LOG_LEVEL", "WARNING").upper()
    log_format = getattr(args, "log_format_flag", None) or os.environ.get(
        "INFERNO_LOG_FORMAT", "text"
    )
    if level not in LOG_LEVELS:
        raise ConfigError(f"INFERNO_LOG_LEVEL={level}: choose one of {', '.join(LOG_LEVELS)}")
    if log_format not in LOG_FORMATS:
        raise ConfigError(
            f"INFERNO_LOG_FORMAT={log_format}: choose one of {', '.join(LOG_FORMATS)}"
        )
    return level, log_format


def _configure_logging_from(settings: Settings, args: argparse.Namespace) -> None:
    """Logging as the settings' `[log]` says, except for a `--log-format` given."""
    args.log_format = args.log_format_flag or settings.log.format
    configure_logging(settings.log.level, args.log_format)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (a flag, or a default
    whose help already says what it is)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str
) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is both its entry in the parent's list and the
    description its own --help starts with."""
    return commands.add_parser(
        name, help=summary, description=summary[0].upper() + summary[1:] + ".",
        formatter_class=_HelpFormatter,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferno", description=_DESCRIPTION, formatter_class=_HelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"inferno {importlib.metadata.version('inferno')}"
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = _command(commands, "generate", "generate one completion and print only its text")
    gen.add_argument(
        "--model", required=True, type=_model_dir, metavar="DIR", help="model directory"
    )
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="render the prompt as a user message, as the API does (gpt-oss: harmony, "
        "printing only the final answer)",
    )
    gen.add_argument(
        "--tensor-parallel-size",
        type=_tensor_parallel_size,
        default=1,
        metavar="N",
        help="split the model across N devices (cuda:0..N-1 with --device cuda; N processes "
        "with gloo on cpu)",
    )
    _add_sampling_args(gen)
    gen.set_defaults(run=_run_generate)

    serve = _command(commands, "serve", "serve the OpenAI-compatible HTTPS API")
    add_config_arg(serve, demo_default=False)
    _add_log_format_arg(serve)
    serve.set_defaults(run=_run_serve)

    demo = _command(
        commands, "demo", "serve the embedded model over HTTPS with demo tokens, unattested"
    )
    demo.add_argument(
        "--model",
        type=_model_dir,
        default=None,
        metavar="DIR",
        help="model directory to serve (default: the embedded SmolLM2-135M-Instruct)",
    )
    _add_device_arg(demo)
    demo.add_argument(
        "--port", type=_port, default=DEMO_PORT, help="port to listen on; 0 picks a free one"
    )
    _add_log_format_arg(demo)
    demo.set_defaults(run=_run_demo)

    audit = _command(commands, "audit", "export the audit log or print its verifier key")
    audit_commands = audit.add_subparsers(required=True, metavar="ACTION")
    export = _command(audit_commands, "export", "write a bundle of the log to verify offline")
    export.add_argument("out", type=Path, help="bundle directory (or tar file) to create")
    add_config_arg(export, demo_default=True)
    export.add_argument("--from", dest="first", type=int, help="first entry (default: 0)")
    export.add_argument("--to", dest="last", type=int, help="last entry (default: the newest)")
    export.add_argument("--tar", action="store_true", help="write one tar file, not a directory")
    export.set_defaults(run=_run_audit_export)
    vkey = _command(
        audit_commands, "vkey", "print the verifier key that auditors pin to verify exports"
    )
    add_config_arg(vkey, demo_default=True)
    vkey.set_defaults(run=_run_audit_vkey)

    token = _command(commands, "token", "print a bearer token of the local issuer (audited)")
    token.add_argument(
        "--role", required=True, choices=[role.value for role in Role], help="the role it grants"
    )
    token.add_argument("--sub", required=True, help="the subject the token names (who uses it)")
    add_config_arg(token, demo_default=True)
    token.set_defaults(run=_run_token)

    link = _command(
        commands, "console-link", "print a one-time link that signs you into the console (audited)"
    )
    link.add_argument(
        "--sub", default="demo-admin", help="the name you sign in as (shown and audited)"
    )
    link.add_argument(
        "--role", choices=[Role.ADMIN.value, Role.AUDITOR.value], default=Role.ADMIN.value,
        help="the console role it grants",
    )  # fmt: skip
    link.add_argument(
        "--url", default=None, metavar="BASE",
        help="where browsers reach the appliance (default: server.host and port of the settings)",
    )  # fmt: skip
    add_config_arg(link, demo_default=True)
    link.set_defaults(run=_run_console_link)

    warm = _command(
        commands, "warmup", "compile the engine's GPU kernels into Triton's cache, ahead of serving"
    )
    add_config_arg(warm, demo_default=False)
    warm.set_defaults(run=_run_warmup)

    trust = _command(commands, "trust", "manage the attestation trust bundle")
    update = _command(trust.add_subparsers(required=True, metavar="ACTION"), "update",
                      "verify and install a signed trust bundle (audited)")  # fmt: skip
    update.add_argument("bundle", type=Path, help="the trust bundle: a directory or a .tar")
    add_config_arg(update, demo_default=False)
    update.set_defaults(run=_run_trust_update)

    model = _command(commands, "model", "manage model directories")
    model_commands = model.add_subparsers(required=True, metavar="ACTION")
    imp = _command(model_commands, "import-gguf", "convert a GGUF file to a model directory")
    imp.add_argument("gguf", type=Path, help="the .gguf file")
    imp.add_argument("outdir", type=Path, help="model directory to create")
    imp.set_defaults(run=_run_import_gguf)
    inspect = _command(
        model_commands, "inspect", "show a model directory's shape and whether Inferno serves it"
    )
    inspect.add_argument("model_dir", type=Path, help="the model directory")
    inspect.set_defaults(run=_run_model_inspect)
    lifecycle.add_commands(commands, _command)
    return parser


def _add_log_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        dest="log_format_flag",
        choices=LOG_FORMATS,
        default=None,
        help="json writes every log line as one JSON object, for log shippers (default: "
        "log.format of the settings, text)",
    )


def _add_device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        type=_device,
        default="cpu",
        metavar="{cpu,cuda,cuda:N}",
        help="cpu, or cuda for the GPU path (bf16, Triton kernels)",
    )


def _device(value: str) -> str:
    # Imported here: pydantic and the model config's modules cost every other command 0.1 s.
    from appliance.engine.engine_config import is_device_name

    if is_device_name(value):
        return value
    raise argparse.ArgumentTypeError(f"invalid device {value!r} (choose cpu, cuda or cuda:N)")


def _tensor_parallel_size(value: str) -> int:
    if value.isdigit() and 1 <= int(value) <= 8:
        return int(value)
    raise argparse.ArgumentTypeError(f"invalid tensor parallel size {value!r} (choose 1 to 8)")


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value!r} (choose 0 to 65535)")
    return port


def _model_dir(value: str) -> Path:
    path = Path(value)
    if path.is_file():
        raise argparse.ArgumentTypeError(
            f"{path} is a file; --model takes a model directory (convert a GGUF with "
            "`inferno model import-gguf`)"
        )
    return path


def _add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = 128) -> None:
    _add_device_arg(parser)
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="most tokens to generate"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: all")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from appliance.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _load_engine(model_dir: Path, device: str, tensor_parallel_size: int = 1) -> Engine:
    from appliance.engine.engine import Engine
    from appliance.engine.engine_config import EngineConfig

    return Engine.from_config(
        EngineConfig(model_dir=model_dir, device=device, tensor_parallel_size=tensor_parallel_size)
    )


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _load_engine(args.model, args.device, args.tensor_parallel_size)
    try:
        if args.chat:
            text = _chat_answer(engine, args.model, args.prompt, params)
        else:
            [completion] = engine.generate([args.prompt], params)
            text = completion.text
    finally:
        engine.close()
    sys.stdout.write(text)
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0


def _chat_answer(engine: Engine, model_dir: Path, prompt: str, params: SamplingParams) -> str:
    """The model's answer to `prompt` as a user message, rendered as the API renders a chat:
    gpt-oss's through the harmony library (appliance.api.harmony, chosen as the API chooses it),
    whose parse of the output gives the final channel's text, never the reasoning; any other
    model's through its chat template, the output as it comes."""
    import dataclasses
    from datetime import UTC, datetime

    from appliance.api.harmony import HarmonyFormat
    from appliance.api.models import config_architectures
    from appliance.api.schemas import ChatMessage

    harmony = HarmonyFormat.of_model(config_architectures(model_dir / "config.json"))
    if harmony is None:
        chat = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        [completion] = engine.generate([chat], params)
        return completion.text
    rendered = harmony.render(
        [ChatMessage(role="user", content=prompt)],
        tools=None,
        reasoning_effort=None,
        today=datetime.now(UTC).date(),
        param="prompt",
    )
    params = dataclasses.replace(
        params, stop_token_ids=(*params.stop_token_ids, *harmony.stop_token_ids)
    )
    [completion] = engine.generate([rendered], params)
    output = harmony.output(None).whole(completion.text, completion.token_ids)
    if not output.content and output.reasoning and completion.finish_reason == "length":
        _log.warning("the model was still reasoning when --max-tokens ran out: raise it")
    return output.content or ""


def _run_import_gguf(args: argparse.Namespace) -> int:
    from appliance.engine.models.gguf_import import import_gguf

    out = import_gguf(args.gguf, args.outdir, show_progress=sys.stderr.isatty())
    print(f"model directory written: {out}", file=sys.stderr)
    return 0


def _run_model_inspect(args: argparse.Namespace) -> int:
    """Exit status 0 when the engine serves the model, 1 when it would refuse it."""
    from appliance.engine.models.inspection import inspect_model

    report = inspect_model(args.model_dir)
    print(report.render())
    return 0 if report.unsupported is None else 1


def _run_warmup(args: argparse.Namespace) -> int:
    from appliance.config import load_settings

    settings = load_settings(settings_file(args.config, demo_default=False))
    if settings.engine.device == "cpu":
        raise ConfigError('engine.device = "cpu": the CPU path compiles no kernels to warm')
    from appliance.boot.startup import engine_config
    from appliance.engine.warmup import warm_up

    report = warm_up(engine_config(settings))
    print(
        f"engine built in {report.build_s:.1f} s, workload run in {report.workload_s:.1f} s; "
        f"Triton compiled {report.compiled} kernels (its cache holds {report.kernels_after})"
    )
    if report.memory_profile_read is not None:
        how = "read from" if report.memory_profile_read else "measured and kept in"
        print(f"the engine's memory profile: {how} the cache")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from appliance.boot.collector_pause import CollectorPause

    # No cyclic garbage collection until the server is ready (or its start stopped): a start
    # keeps what it makes, and every full collection on the way visits all of it.
    with CollectorPause.begin() as collector:
        from appliance.config import load_settings

        # Settings first: their errors answer at once, before torch and the app are imported.
        settings = load_settings(settings_file(args.config, demo_default=False))
        _configure_logging_from(settings, args)
        from appliance.boot.engine_preload import EnginePreload

        # torch, Triton and the kernels import in the background while the app is built, the
        # audit log opens and the TEE is attested; the engine's GPU set-up follows the verdict.
        preload = EnginePreload.start(settings.engine)
        from appliance.app import build
        from appliance.boot.startup import start_audit_log
        from appliance.server import listen, serve

        # The app closes the log at its shutdown (after a SIGTERM the process ends right
        # after); closing it here as well covers a start that fails before serving.
        with start_audit_log(settings) as audit_log:
            app = build(settings, audit_log, preload=preload, collector=collector)
            listener = listen(settings)
            serve(settings, app, listener)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from appliance.app import build
    from appliance.boot.startup import engine_config, start_audit_log
    from appliance.boot.weights import LoadedModel
    from appliance.config import load_settings
    from appliance.engine.models.gguf_import import import_gguf
    from appliance.server import listen, serve
    from installer.demo import commit_demo_config, demo_dir, stage_demo_config
    from installer.embedded_model import default_model_dir, find_embedded_gguf

    model_dir = args.model
    if model_dir is None:
        model_dir = default_model_dir()
        if not (model_dir / "config.json").exists():
            _log.info("converting the embedded model into %s ...", model_dir)
            import_gguf(find_embedded_gguf(), model_dir, show_progress=sys.stderr.isatty())
    # The settings go into place only once the demo listens: a second demo that cannot start
    # (its port taken by the first, say) leaves the running one's settings file as it is.
    staged = stage_demo_config(demo_dir(), model_dir, device=args.device, port=args.port)
    try:
        settings = load_settings(staged)
        _configure_logging_from(settings, args)
        with start_audit_log(settings) as audit_log:
            listener = listen(settings)
            config_path = commit_demo_config(staged)
            _log.info("loading %s ...", settings.served_model_name)
            # Loaded before serving, so the server is ready when the banner says so.
            model = LoadedModel.load(engine_config(settings))
            app = build(settings, audit_log, model=model)
            tokens_file = _write_demo_tokens(settings, audit_log, config_path.parent)
            print(_demo_banner(settings, listener.url, tokens_file), flush=True)
            serve(settings, app, listener)
    finally:
        staged.unlink(missing_ok=True)
    return 0


def _write_demo_tokens(settings: Settings, audit_log: AuditLog, directory: Path) -> Path:
    """Mint a user and an admin token (each recorded in the audit log) and write them to the
    demo's owner-only tokens file; its path."""
    from datetime import UTC, datetime, timedelta

    from installer.demo import write_tokens_file

    tokens = {
        role.value: _mint(settings, audit_log, role, f"demo-{role}", "inferno demo")
        for role in (Role.USER, Role.ADMIN)
    }
    ttl_s = settings.auth.local_issuer_token_ttl_s
    expires = (datetime.now(UTC) + timedelta(seconds=ttl_s)).isoformat(timespec="seconds")
    return write_tokens_file(directory, tokens, expires=expires)


def _demo_banner(settings: Settings, url: str, tokens_file: Path) -> str:
    from appliance.tls import certificate_fingerprint
    from installer.demo import DemoBanner

    cert = settings.tls.cert_file
    assert cert is not None, "the demo's settings name a certificate"
    return DemoBanner(
        model=settings.served_model_name,
        url=url,
        cert_file=cert,
        fingerprint=certificate_fingerprint(cert),
        tokens_file=tokens_file,
        token_ttl_s=settings.auth.local_issuer_token_ttl_s,
        python=sys.executable,
    ).text()


def _mint(settings: Settings, log: AuditLog, role: Role, subject: str, command: str) -> str:
    """A local-issuer token, recorded in the audit log (`admin.token.issue`: who ran `command`,
    the role, subject, token id and expiry; never the token) before it is signed. A token
    whose issue cannot be recorded is not made."""
    import time

    from appliance.auth.local_issuer import TOKEN_ISSUE, TokenRequestError

    issuer = _local_issuer(settings)
    try:
        issued = issuer.plan({role}, subject, time.time())
    except TokenRequestError as exc:
        raise ConfigError(f"no token: {exc}") from None
    _record_local_action(log, command, TOKEN_ISSUE, issued.audit_target())
    return issuer.sign(issued)


def _local_issuer(settings: Settings) -> LocalIssuer:
    from appliance.auth.local_issuer import LocalIssuer

    issuer = LocalIssuer.from_settings(settings.auth)
    if issuer is None:
        raise ConfigError(
            "auth.local_issuer is off in these settings: tokens come from the identity provider"
        )
    return issuer


def _record_local_action(
    log: AuditLog, command: str, operation: str, target: dict[str, Any]
) -> None:
    """Append `admin.<operation>` naming who runs `command` here; raises if it cannot."""
    from datetime import UTC, datetime

    from audit.event import Outcome, admin_action

    log.append(
        admin_action(
            time=datetime.now(UTC),
            actor=_local_operator(command),
            source_address=None,
            request_id=None,
            operation=operation,
            outcome=Outcome.SUCCESS,
            target=target,
        )
    )


def _run_token(args: argparse.Namespace) -> int:
    from appliance.boot.audit_log import open_audit_log
    from appliance.config import load_settings

    settings = load_settings(settings_file(args.config, demo_default=True))
    with open_audit_log(settings.audit) as log:
        token = _mint(settings, log, Role(args.role), args.sub, "inferno token")
    print(token)
    return 0


def _run_console_link(args: argparse.Namespace) -> int:
    """Print a sign-in link of the local issuer (appliance.auth.console_ticket), its issue
    recorded in the audit log (`admin.console.sign_in_link`, the ticket's id, never the
    ticket) before it is printed."""
    import time
    from datetime import UTC, datetime

    from appliance.auth.console_ticket import TicketError, mint_console_ticket
    from appliance.boot.audit_log import open_audit_log
    from appliance.config import load_settings

    settings = load_settings(settings_file(args.config, demo_default=True))
    base = args.url.rstrip("/") if args.url else _console_origin(settings)
    issuer = _local_issuer(settings)
    try:
        text, ticket = mint_console_ticket(issuer, Role(args.role), args.sub, time.time())
    except TicketError as exc:
        raise ConfigError(f"no link: {exc}") from None
    target = {
        "issuer": ticket.principal.issuer,
        "subject": ticket.principal.subject,
        "roles": sorted(ticket.principal.roles),
        "ticket_id": ticket.ticket_id,
        "expires": datetime.fromtimestamp(ticket.expires_at, UTC).isoformat(),
    }
    with open_audit_log(settings.audit) as log:
        _record_local_action(log, "inferno console-link", "console.sign_in_link", target)
    print(f"{base}/console/login/local?ticket={text}")
    return 0


def _console_origin(settings: Settings) -> str:
    """The origin the settings serve on, as a browser on this machine reaches it."""
    server = settings.server
    if server.port == 0:
        raise ConfigError(
            "the settings name port 0 (a free port picked at start): give --url https://HOST:PORT"
        )
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
    scheme = "http" if server.insecure_http else "https"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{server.port}"


def _run_audit_export(args: argparse.Namespace) -> int:
    from appliance.boot.audit_log import open_audit_log
    from appliance.config import load_settings
    from audit.export import ExportRequest, export_bundle

    settings = load_settings(settings_file(args.config, demo_default=True))
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

    audit = load_settings(settings_file(args.config, demo_default=True)).audit
    print(load_note_signer(audit.effective_key_dir / SIGNING_KEY_FILE, audit.origin).verifier)
    return 0


def _run_trust_update(args: argparse.Namespace) -> int:
    from appliance.trust_store import update_trust

    config = settings_file(args.config, demo_default=False)
    print(update_trust(config, args.bundle, _local_operator("inferno trust update")))
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
