"""The `inferno` command as a user runs it: a separate process, real files."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import jwt
import openai
import pytest
from openai_harmony import (
    Conversation,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    SystemContent,
    load_harmony_encoding,
)
from openai_harmony import Role as HarmonyRole

from appliance.__main__ import _parser, main
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.roles import Role
from appliance.boot.audit_log import open_audit_log
from appliance.config import load_settings
from appliance.engine.engine import Completion, Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.tokenizer import Tokenizer
from appliance.settings_file import CONFIG_ENV
from appliance.tls import certificate_fingerprint
from tests.appliance.api.harmony_model import write_harmony_model
from tests.appliance.api.scripted_model import ScriptedModel

AUDIT = (
    '[audit]\norigin = "inferno.test/cli"\ndata_dir = "audit"\n'
    '[appliance]\nprofile = "development"\n[tee]\nmode = "insecure-dev"\n'
    '[auth]\nlocal_issuer = "demo"\nlocal_issuer_key_file = "auth/issuer.pem"\n'
)


def _inferno(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_generate_chat_prints_only_the_greedy_completion(
    smollm2_dir: Path, smollm2_engine: Callable[..., Engine]
) -> None:
    question = "Name a famous painting by Leonardo da Vinci."
    result = _inferno(
        "generate", "--model", str(smollm2_dir), "--prompt", question, "--chat",
        "--max-tokens", "24", "--temperature", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    engine = smollm2_engine()
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}])
    prompt = tok.encode(text, add_special_tokens=False)
    [expected] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))
    assert result.stdout == expected.text
    assert expected.text


@pytest.mark.slow
def test_generate_on_three_processes_prints_what_one_process_prints(smollm2_dir: Path) -> None:
    """--tensor-parallel-size 3: the embedded model split over 3 gloo processes (9 heads, 3 KV
    heads), greedy, gives the same text; the workers are gone when the command ends."""
    args = ("generate", "--model", str(smollm2_dir), "--prompt", "The sky is", "--max-tokens", "8")
    single = _inferno(*args)
    parallel = _inferno(*args, "--tensor-parallel-size", "3")
    assert single.returncode == 0 and parallel.returncode == 0, parallel.stderr
    assert parallel.stdout == single.stdout and single.stdout


@pytest.fixture(scope="module")
def harmony_encoding() -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def gpt_oss_dir(
    harmony_encoding: HarmonyEncoding, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return write_harmony_model(harmony_encoding, tmp_path_factory.mktemp("gpt-oss"))


def _scripted_gpt_oss(
    gpt_oss_dir: Path, monkeypatch: pytest.MonkeyPatch, encoding: HarmonyEncoding, reply: str
) -> list[list[int]]:
    """`inferno generate` in this process loads the tiny gpt-oss directory with a network
    that answers `reply` (harmony text, as token ids); returns the prompts it is given."""
    scripted = ScriptedModel(gpt_oss_dir, Tokenizer.from_model_dir(gpt_oss_dir))
    scripted.say_tokens(encoding.encode(reply, allowed_special="all"))
    config = EngineConfig(model_dir=gpt_oss_dir, max_model_len=1024, num_kv_blocks=64,
                          enable_prefix_caching=False)  # fmt: skip
    engine = Engine.build(config, scripted, scripted._tokenizer)  # type: ignore[arg-type]
    prompts: list[list[int]] = []
    generate = engine.generate

    def recording_generate(batch: list[list[int]], params: SamplingParams) -> list[Completion]:
        prompts.extend(list(p) for p in batch)
        return generate(batch, params)

    monkeypatch.setattr(engine, "generate", recording_generate)
    monkeypatch.setattr("appliance.__main__._load_engine", lambda *args: engine)
    return prompts


def test_generate_chat_renders_gpt_oss_through_harmony_and_prints_the_final_channel_only(
    gpt_oss_dir: Path,
    harmony_encoding: HarmonyEncoding,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As the API serves gpt-oss: the prompt is the harmony library's rendering of the user's
    message (not a chat template's), and what is printed is the final channel's text, never
    the analysis channel's reasoning."""
    thought, answer = "The user asks for a colour. Blue is common.", "Blue."
    reply = (
        f"<|channel|>analysis<|message|>{thought}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{answer}<|return|>"
    )
    prompts = _scripted_gpt_oss(gpt_oss_dir, monkeypatch, harmony_encoding, reply)
    question = "Name a colour."
    status = main(["generate", "--model", str(gpt_oss_dir), "--prompt", question, "--chat"])
    assert status == 0
    assert capsys.readouterr().out == answer
    # The library's own rendering of the conversation, built here without Inferno's code.
    system = SystemContent.new().with_conversation_start_date(datetime.now(UTC).date().isoformat())
    conversation = Conversation.from_messages(
        [
            Message.from_role_and_content(HarmonyRole.SYSTEM, system),
            Message.from_role_and_content(HarmonyRole.USER, question),
        ]
    )
    expected = harmony_encoding.render_conversation_for_completion(
        conversation, HarmonyRole.ASSISTANT
    )
    assert prompts == [expected]


def test_generate_chat_on_gpt_oss_cut_off_while_reasoning_prints_no_reasoning(
    gpt_oss_dir: Path,
    harmony_encoding: HarmonyEncoding,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    reply = "<|channel|>analysis<|message|>Let me think about colours for a long while"
    _scripted_gpt_oss(gpt_oss_dir, monkeypatch, harmony_encoding, reply)
    args = ["generate", "--model", str(gpt_oss_dir), "--prompt", "Name a colour.", "--chat"]
    assert main([*args, "--max-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "still reasoning when --max-tokens ran out" in captured.err
    assert "colours" not in captured.err


def test_generate_refuses_a_tensor_parallel_size_the_heads_cannot_split(smollm2_dir: Path) -> None:
    result = _inferno(
        "generate", "--model", str(smollm2_dir), "--prompt", "hi", "--tensor-parallel-size", "2"
    )
    assert result.returncode == 2
    assert "tensor_parallel_size 2 does not divide the model's num_attention_heads (9)" in (
        result.stderr
    )


def test_generate_with_an_unknown_model_dir_says_so_and_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = _inferno("generate", "--model", str(missing), "--prompt", "hi")
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"model directory {missing} does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_with_a_corrupt_safetensors_file_names_the_file(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((smollm2_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    result = _inferno("generate", "--model", str(broken), "--prompt", "hi")
    assert result.returncode == 2
    assert "model.safetensors is not a valid safetensors file" in result.stderr


def test_generate_with_bad_sampling_parameters_names_the_parameter(smollm2_dir: Path) -> None:
    result = _inferno("generate", "--model", str(smollm2_dir), "--prompt", "hi", "--top-p", "1.5")
    assert result.returncode == 2
    assert "'top_p'" in result.stderr


def test_import_gguf_of_a_missing_file_fails_cleanly(tmp_path: Path) -> None:
    result = _inferno("model", "import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "x.gguf" in result.stderr
    assert not (tmp_path / "out").exists()


def test_serve_with_a_bad_setting_exits_2_naming_it(smollm2_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "inferno.toml"
    config.write_text(f'{AUDIT}[model]\ndir = "{smollm2_dir}"\n[server]\nport = "high"\n')
    result = _inferno("serve", "--config", str(config))
    assert result.returncode == 2
    assert "server.port: " in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_without_tls_material_refuses_to_start(smollm2_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "inferno.toml"
    config.write_text(f'{AUDIT}[model]\ndir = "{smollm2_dir}"\n')
    result = _inferno("serve", "--config", str(config))
    assert result.returncode == 2
    assert "TLS is always on" in result.stderr


def _plain_http_config(model_dir: Path, directory: Path) -> Path:
    config = directory / "inferno.toml"
    config.write_text(
        f'{AUDIT}[model]\ndir = "{model_dir}"\n[server]\nport = 0\ninsecure_http = true\n'
    )
    return config


def test_serve_refuses_to_start_when_its_audit_log_cannot_be_opened(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    config = _plain_http_config(smollm2_dir, tmp_path)
    (tmp_path / "audit").write_text("a file where the log's directory should be")
    result = _inferno("serve", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.startswith("inferno: error: the audit log cannot be opened")
    assert "serving" not in result.stderr
    assert "Traceback" not in result.stderr


def test_audit_vkey_before_the_log_exists_says_so(smollm2_dir: Path, tmp_path: Path) -> None:
    result = _inferno("audit", "vkey", "--config", str(_plain_http_config(smollm2_dir, tmp_path)))
    assert result.returncode == 2
    assert "there is no signing key at" in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "audit" / "keys" / "log-signing.key").exists()


def test_audit_export_over_an_existing_path_is_refused(smollm2_dir: Path, tmp_path: Path) -> None:
    config = _plain_http_config(smollm2_dir, tmp_path)
    (tmp_path / "taken").mkdir()
    result = _inferno("audit", "export", str(tmp_path / "taken"), "--config", str(config))
    assert result.returncode == 2
    assert "taken already exists; choose a new path" in result.stderr


@pytest.mark.slow
def test_demo_serves_the_embedded_model_over_https_and_says_how_to_call_it(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    env.pop(CONFIG_ENV, None)
    demo_dir = tmp_path / "data" / "inferno" / "demo"
    with (tmp_path / "stderr.txt").open("w") as stderr:
        demo = subprocess.Popen(
            [sys.executable, "-m", "appliance", "demo", "--model", str(smollm2_dir), "--port", "0"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
        )  # fmt: skip
        try:
            banner = _read_banner(demo)
            url = re.search(r"on (https://127\.0\.0\.1:\d+)", banner[0]).group(1)
            cert = Path(re.search(r"\(self-signed\): (\S+)", banner[1]).group(1))
            fingerprint = re.search(r"SHA-256 fingerprint (\S+)", banner[2]).group(1)
            assert cert == demo_dir / "tls" / "cert.pem"
            assert fingerprint == certificate_fingerprint(cert)
            # The tokens are in an owner-only file the banner names, never on the terminal.
            tokens_file = Path(re.search(r": (\S+) \(owner-only\)", banner[3]).group(1))
            assert tokens_file == demo_dir / "tokens.env"
            assert tokens_file.stat().st_mode & 0o777 == 0o600
            tokens = dict(re.findall(r"^export (\w+)=(\S+)$", tokens_file.read_text(), re.M))
            user_token, admin_token = tokens["INFERNO_USER_TOKEN"], tokens["INFERNO_ADMIN_TOKEN"]
            assert user_token not in "\n".join(banner) and admin_token not in "\n".join(banner)
            # The banner's OpenAI line runs as printed, once the tokens file is loaded.
            [openai_line] = [line.strip() for line in banner if "openai.OpenAI(" in line]
            answer = subprocess.run(
                ["sh", "-c", f". {tokens_file}; {openai_line}"],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            assert answer.returncode == 0, answer.stderr
            assert answer.stdout.strip()
            assert f"curl --cacert {cert} {url}/v1/chat/completions" in "\n".join(banner)
            client = openai.OpenAI(
                base_url=f"{url}/v1",
                api_key=user_token,
                http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert)),
            )
            raw = client.chat.completions.with_raw_response.create(
                model=smollm2_dir.name,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=8,
            )
            assert raw.parse().choices[0].message.content
            assert raw.headers["audit-entry"].startswith("inferno-demo.localhost/audit ")
            # Nothing is attested in a demo, and both the banner and every response say so.
            assert raw.headers["x-inferno-tee"] == "UNVERIFIED"
            assert _line(banner, "TEE: UNVERIFIED")
            # `inferno audit` finds the demo's settings by itself, as `inferno token` does.
            shown = _inferno("audit", "vkey", env=env)
            assert shown.returncode == 0, shown.stderr
            assert shown.stdout.startswith("inferno-demo.localhost/audit+")
            exported = _inferno("audit", "export", str(tmp_path / "bundle"), env=env)
            assert exported.returncode == 0, exported.stderr
            # The admin token reads the metrics, the user's does not; `inferno token` mints more.
            with httpx.Client(verify=ssl.create_default_context(cafile=cert)) as http:
                metrics = f"{url}/metrics"
                assert http.get(metrics, headers=_bearer(admin_token)).status_code == 200
                assert http.get(metrics, headers=_bearer(user_token)).status_code == 403
                minted = _inferno("token", "--role", "auditor", "--sub", "carol", env=env)
                assert minted.returncode == 0, minted.stderr
                proof = f"{url}/v1/audit/proof/0"
                assert http.get(proof, headers=_bearer(minted.stdout.strip())).status_code == 200
                assert http.get(proof, headers=_bearer(admin_token)).status_code == 403
                # The banner says where the console is; `inferno console-link` signs an admin
                # in there once (--url: this demo listens on a port picked at start).
                assert _line(banner, "Console:").startswith(f"Console: {url}/console/ ")
                assert "inferno console-link" in _line(banner, "Console:")
                linked = _inferno("console-link", "--url", url, env=env)
                assert linked.returncode == 0, linked.stderr
                signed_in = http.get(linked.stdout.strip())
                assert signed_in.status_code == 200 and "Signed in" in signed_in.text
                assert http.get(f"{url}/console/system").status_code == 200
                assert http.get(linked.stdout.strip()).status_code == 400  # once only
        finally:
            demo.send_signal(signal.SIGTERM)
            demo.wait(timeout=60)
    logged = (tmp_path / "stderr.txt").read_text()
    assert "INFO appliance.boot.startup: ready: " in logged
    assert logged.rstrip().endswith("INFO appliance.server: stopped")
    assert user_token not in logged
    assert (demo_dir / "inferno.toml").is_file()


def test_a_second_demo_that_cannot_listen_leaves_the_first_ones_settings(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    demo_dir = tmp_path / "data" / "inferno" / "demo"
    demo_dir.mkdir(parents=True)
    (demo_dir / "inferno.toml").write_text("# the running demo's settings\n")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    with socket.create_server(("127.0.0.1", 0)) as running:  # the first demo's port
        port = running.getsockname()[1]
        second = _inferno(
            "demo", "--model", str(smollm2_dir), "--port", str(port), env=env
        )  # fmt: skip
    assert second.returncode == 2
    assert f"server.port = {port}: " in second.stderr and "choose another" in second.stderr
    assert (demo_dir / "inferno.toml").read_text() == "# the running demo's settings\n"
    assert not [path for path in demo_dir.iterdir() if path.name.startswith(".")]


def _line(banner: list[str], start: str) -> str:
    return next(line for line in banner if line.strip().startswith(start))


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _read_banner(process: subprocess.Popen[str]) -> list[str]:
    """The demo's banner, up to its last line (the OpenAI client's command)."""
    assert process.stdout is not None
    lines: list[str] = []
    while not lines or "SSL_CERT_FILE=" not in lines[-1]:
        line = process.stdout.readline()
        assert line, f"the demo exited before printing its banner (status {process.poll()})"
        lines.append(line.rstrip("\n"))
    return lines


def test_token_prints_a_token_only_where_the_local_issuer_is_on(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    config = tmp_path / "inferno.toml"
    config.write_text(f'{AUDIT}[model]\ndir = "{model_dir}"\n[server]\ninsecure_http = true\n')
    minted = _inferno("token", "--role", "admin", "--sub", "ops-alice", "--config", str(config))
    assert minted.returncode == 0, minted.stderr
    claims = jwt.decode(minted.stdout.strip(), options={"verify_signature": False})
    assert (claims["sub"], claims["roles"]) == ("ops-alice", ["admin"])
    assert (tmp_path / "auth" / "issuer.pem").stat().st_mode & 0o777 == 0o600
    # The issue is in the audit log: who ran the command, for whom, the token's id, not the token.
    with open_audit_log(load_settings(config).audit) as log:
        leaves = [leaf for _, leaf in log.store.entries(0, log.store.size() - 1)]
    [issued] = [json.loads(leaf) for leaf in leaves if b'"admin.token.issue"' in leaf]
    assert issued["actor"]["client"] == "inferno token"
    target = issued["details"]["target"]
    assert (target["subject"], target["roles"]) == ("ops-alice", ["admin"])
    assert target["token_id"] == claims["jti"]
    assert not any(minted.stdout.strip().encode() in leaf for leaf in leaves)
    unknown = _inferno("token", "--role", "root", "--sub", "x", "--config", str(config))
    assert unknown.returncode == 2 and "invalid choice: 'root'" in unknown.stderr
    idp = (
        '[auth]\njwks_cache_dir = "jwks"\n[[auth.issuers]]\nissuer = "https://idp.example.com"\n'
        'audience = "inferno"\nrole_claims = ["roles"]\nroles = { user = ["u"] }\n'
    )
    config.write_text(
        AUDIT.split("[auth]")[0]
        + f'[model]\ndir = "{model_dir}"\n[server]\ninsecure_http = true\n'
        + idp
    )
    refused = _inferno("token", "--role", "admin", "--sub", "x", "--config", str(config))
    assert refused.returncode == 2
    assert "auth.local_issuer is off in these settings" in refused.stderr
    assert refused.stdout == ""


def test_version_prints_the_installed_version() -> None:
    result = _inferno("--version")
    assert result.returncode == 0
    assert result.stdout == f"inferno {importlib.metadata.version('inferno')}\n"


def _subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


def test_every_subcommands_help_has_a_one_line_description_and_shows_defaults() -> None:
    subcommands = dict(_subcommands(_parser()))
    assert {" ".join(path) for path in subcommands} >= {
        "generate", "serve", "demo", "audit", "audit export", "audit vkey", "token", "model",
        "model import-gguf", "model inspect",
    }  # fmt: skip
    for path, parser in subcommands.items():
        result = _inferno(*path, "--help")
        assert result.returncode == 0, result.stderr
        description = result.stdout.split("\n\n")[1]
        assert parser.description == description.replace("\n", " ")
        assert len(parser.description) <= 80 and parser.description.endswith(".")
        for action in parser._actions:
            if action.default not in (None, False, argparse.SUPPRESS) and action.help:
                flag = action.option_strings[-1]
                options = result.stdout.split("\noptions:\n")[1]
                shown = re.search(rf"^  {flag} .*?(?=\n  -|\Z)", options, re.S | re.M).group(0)
                # argparse wraps long lines, possibly inside "(default: ...)"
                assert "(default: " in " ".join(shown.split()), (
                    f"inferno {' '.join(path)} {flag}: no default"
                )
    generate = _inferno("generate", "--help").stdout
    assert "(default: cpu)" in generate and "(default: 128)" in generate


def test_device_is_a_choice_of_cpu_cuda_or_cuda_n(tmp_path: Path) -> None:
    result = _inferno("generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "gpu")
    assert result.returncode == 2
    assert "invalid device 'gpu' (choose cpu, cuda or cuda:N)" in result.stderr
    assert "{cpu,cuda,cuda:N}" in _inferno("demo", "--help").stdout


def test_a_model_path_that_is_a_file_says_to_convert_it(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for command in ("generate", "demo"):
        result = _inferno(command, "--model", str(gguf), "--prompt", "hi")
        assert result.returncode == 2
        assert (
            f"{gguf} is a file; --model takes a model directory (convert a GGUF with "
            "`inferno model import-gguf`)" in result.stderr
        )


# A shell's status for a process that SIGPIPE ended: what `inferno` returns when stdout closes.
_SIGPIPE_STATUS = 141


def _into_a_closed_pipe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `inferno ARGS` with stdout a pipe whose reader is gone (as after `| head` exits):
    its exit status and stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "appliance", *args],
            stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, timeout=300,
            check=False,
        )  # fmt: skip
    finally:
        os.close(write_end)
    return result.returncode, result.stderr


def test_output_into_a_closed_pipe_ends_quietly(smollm2_dir: Path, tmp_path: Path) -> None:
    config = _plain_http_config(smollm2_dir, tmp_path)
    minted = _inferno("token", "--role", "user", "--sub", "x", "--config", str(config))
    assert minted.returncode == 0, minted.stderr  # the audit log, and its key, exist now
    for args in (("--help",), ("--version",), ("audit", "vkey", "--config", str(config))):
        status, stderr = _into_a_closed_pipe(*args)
        assert (status in (0, _SIGPIPE_STATUS), stderr) == (True, ""), args
    piped = subprocess.run(
        f"{sys.executable} -m appliance --help | head -1", shell=True,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert piped.stdout.startswith("usage: inferno") and piped.stderr == ""


@pytest.mark.slow
def test_generate_into_a_closed_pipe_ends_quietly(smollm2_dir: Path) -> None:
    status, stderr = _into_a_closed_pipe(
        "generate", "--model", str(smollm2_dir), "--prompt", "hi", "--max-tokens", "2"
    )
    assert (status, stderr) == (_SIGPIPE_STATUS, "")


def test_inferno_config_names_the_settings_file_and_config_wins(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    named = _plain_http_config(smollm2_dir, tmp_path / "a")
    given = tmp_path / "b" / "inferno.toml"
    given.write_text(named.read_text().replace("inferno.test/cli", "inferno.test/given"))
    env = {**os.environ, CONFIG_ENV: str(named), "XDG_DATA_HOME": str(tmp_path / "none")}
    assert _inferno("token", "--role", "user", "--sub", "x", env=env).returncode == 0
    assert _inferno("audit", "vkey", env=env).stdout.startswith("inferno.test/cli+")
    with_config = ("--config", str(given))
    assert _inferno("token", "--role", "user", "--sub", "x", *with_config, env=env).returncode == 0
    assert _inferno("audit", "vkey", *with_config, env=env).stdout.startswith("inferno.test/given+")


def test_commands_without_a_settings_file_say_how_to_name_one(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop(CONFIG_ENV, None)
    serve = _inferno("serve", env=env)
    assert serve.returncode == 2
    assert "no settings file: give --config FILE or set INFERNO_CONFIG=FILE" in serve.stderr
    for args in (("audit", "vkey"), ("audit", "export", str(tmp_path / "out"))):
        result = _inferno(*args, env=env)
        assert result.returncode == 2
        assert f"the demo's, {tmp_path}/inferno/demo/inferno.toml, does not exist" in result.stderr


@pytest.mark.slow
def test_serve_with_json_logs_writes_one_object_a_line_with_ready_access_and_stop(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    config = _plain_http_config(smollm2_dir, tmp_path)
    serve = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config),
         "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert serve.stderr is not None
    try:
        lines = []
        while "ready: " not in (lines[-1] if lines else ""):
            line = serve.stderr.readline()
            assert line, f"serve exited (status {serve.poll()}): {''.join(lines)}"
            lines.append(line)
        [url] = [
            found.group(1)
            for line in lines
            if (found := re.fullmatch(r"serving \S+ on (http://\S+)", json.loads(line)["message"]))
        ]
        issuer = LocalIssuer.from_settings(load_settings(config, environ={}).auth)
        token = issuer.mint(Role.USER, "json-reader", time.time())
        assert httpx.get(f"{url}/v1/models", headers=_bearer(token)).status_code == 200
    finally:
        serve.send_signal(signal.SIGTERM)
        _, rest = serve.communicate(timeout=60)
    parsed = [json.loads(line) for line in [*lines, *rest.splitlines()]]
    messages = [line["message"] for line in parsed]
    assert any(m.startswith("ready: the model is loaded and inference is served") for m in messages)
    assert messages[-2].startswith("stopping: ") and messages[-1] == "stopped"
    [access] = [line for line in parsed if line["logger"] == "appliance.api.access_log"]
    assert (access["method"], access["route"], access["status"]) == ("GET", "/v1/models", 200)
    assert access["subject"] == "json-reader"
    assert token not in rest


def test_inferno_runs_the_cuda_allocator_in_expandable_segments_unless_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
