"""W5 of PERFORMANCE.md: a sealed model's cold start, from process start to the first token.

Setup (not timed): the Llama-3.1-8B architecture with random bf16 weights written as safetensors
(a WordLevel tokenizer of its 128,256 ids, `t0` ... `t128255`, so requests can be text), sealed
with the `file` key provider, the plaintext deleted; Triton's cache filled by `inferno warmup`
(the offline bundle ships it, docs/INSTALL.md); synthetic TEE devices and their policy.

Each run starts a new process (`--serve`) that does what `inferno serve` does: the cyclic
garbage collector paused until the server is ready (appliance.boot.collector_pause), the engine's
preload started in the background (appliance.boot.engine_preload: torch, Triton and the kernels
imported; after the verdict the CUDA context, cuBLAS and Triton's first launch), the server's
own imports, settings, the audit log (`boot.start`), then the start-up sequence of
appliance.boot.startup with the real verifiers over synthetic GPU and SEV-SNP evidence
(tests/appliance/attestation/synthetic_tee.py, as the e2e tests: the appliance cannot attest on
a machine with CC off), the key release, decryption straight into GPU memory, the wait for the
preload, the engine's build (KV pool, profiled step, the largest CUDA graphs to measure their
pool). This process polls /health every 10 ms and, once ready, asks for one token, then polls
/metrics until the engine has captured every CUDA graph (it does while idle, once ready: the
first request is served eagerly unless a graph for it is captured by then); that time is
reported beside W5, not in it.

Phases, as issue 17 names them: audit open, attestation, key release, the load's wait for torch
(the preload imports it), decrypt + load, warm-up / graph capture, first token; from the audit
log's own records where it has them (boot.ready's `attestation_ms` and `load_phases_ms`) and
from the two processes' clocks otherwise. Beside them, the preload's two stages, which run in
the background: the sum of all phases exceeds the wall time by what overlapped. The synthetic
devices are made in the serving process before its start-up begins, and before the preload
starts (their keys cannot cross processes); that time is measured and taken out, since a real
machine has its devices already. Each run lists the subprocesses the serving process started
(when, and in which thread: `engine-preload` is off the start's path).

Bytecode (`--bytecode`): an installed appliance runs from bytecode pip compiled at install, while
the GPU machine sets PYTHONDONTWRITEBYTECODE=1 and so compiles every module of torch from source
at each start. By default (`installed`) an untimed serving run first writes the bytecode of
every module a start imports into a PYTHONPYCACHEPREFIX of the work directory, and the timed
runs read it (and write nothing): what an installed appliance pays. `none` measures the
environment as it is.

    python bench/cold_start.py [--shape 8b|tiny] [--device cuda|cpu] [--runs 3] [--dir DIR]
        [--drop-caches] [--bytecode installed|none] [--baseline] [--collector-baseline]

`--baseline`: each run is preceded by one without the preload (the start as it was before it),
on the same machine, model and bytecode, for comparison. `--collector-baseline`: likewise, by
one whose garbage collector runs through the start (as before the pause).
"""

from __future__ import annotations

import time

_STARTED_S = time.time()  # first: this process's own start, for the --serve child

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import tomllib  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TINY = {
    **LLAMA_31_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
KEY_ID = "cold-start-kek"
MODEL_NAME = "random-llama"
SHARD_BYTES = 5 << 30


# ---- setup (not timed) -------------------------------------------------------------------


def write_random_model(directory: Path, shape: dict[str, Any], device: str) -> None:
    """config.json, a WordLevel tokenizer of the vocabulary, and random bf16 safetensors in
    shards of about 5 GiB, drawn on `device` one tensor at a time."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(shape))
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim, heads, kv_heads = (
        shape["head_dim"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    shapes = {
        "model.embed_tokens.weight": (shape["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (shape["vocab_size"], hidden),
    }
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }
    generator = torch.Generator(device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            index += 1
            save_file(shard, str(directory / f"model-{index:05d}.safetensors"))
            shard, shard_bytes = {}, 0

    for name, size in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(size, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(size, dtype=torch.bfloat16, device=device)
            tensor.normal_(0.0, 0.02, generator=generator)
        shard[name] = tensor.cpu()
        shard_bytes += shard[name].numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()


def seal(plain: Path, sealed: Path, keys: Path) -> Path:
    """Seal `plain` into `sealed` with the file provider's key in `keys`; the manifest's
    public key file."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from attestation.keys.file import FileKeyProvider
    from attestation.sealed.writer import seal_model

    provider = FileKeyProvider(keys, production=False)
    provider.create_key(KEY_ID)
    signing = Ed25519PrivateKey.generate()
    seal_model(
        plain,
        sealed,
        model_id=MODEL_NAME,
        key_id=KEY_ID,
        wrap_data_key=provider.wrap_data_key,
        signing_key=signing,
        workers=min(8, os.cpu_count() or 1),
    )
    public = keys / "manifest.pub"
    public.write_bytes(
        signing.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    return public


def settings_file(work: Path, device: str, manifest_pub: Path) -> Path:
    """The settings of every run; `[tee]` is completed by the serving process, which makes the
    synthetic devices (their policy and roots)."""
    path = work / "inferno.toml"
    path.write_text(f'''appliance.profile = "development"
[model]
dir = "{work / "sealed"}"
name = "{MODEL_NAME}"
[engine]
device = "{device}"
max_model_len = 8192
triton_cache_dir = "{work / "triton-cache"}"
[server]
insecure_http = true
host = "127.0.0.1"
port = 0
[audit]
origin = "bench.inferno/cold-start"
data_dir = "{work / "audit"}"
[auth]
local_issuer = "demo"
local_issuer_key_file = "{work / "issuer.pem"}"
[sealed]
manifest_public_key_file = "{manifest_pub}"
key_provider = "file"
file_key_dir = "{work / "keys"}"
''')
    return path


# ---- one run: the serving process --------------------------------------------------------

# The NVML UUID of the GPU the engine uses, which the synthetic GPU's evidence then declares as
# a real collector's would (the boot gate matches the verdict's GPUs with the engine's): read
# by the parent with nvidia-smi, so that the serving process touches no GPU before its verdict.
_GPU_UUID_VARIABLE = "INFERNO_BENCH_GPU_UUID"


class _NamedGpus:
    """A synthetic GPU evidence source whose evidence names `uuid` as the collector does."""

    def __init__(self, source, uuid: str):
        self.source, self.uuid = source, uuid

    def num_gpus(self) -> int:
        return self.source.num_gpus()

    def collect(self, nonces):
        return [dataclasses.replace(e, uuid=self.uuid) for e in self.source.collect(nonces)]

    def set_ready(self) -> None:
        self.source.set_ready()


def gpu_uuid() -> str:
    """The first GPU's NVML UUID (`GPU-...`), from nvidia-smi."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def serve(config: Path, spawned_s: float, with_preload: bool, pause_collector: bool) -> None:
    """What `inferno serve` does (the collector paused, the engine's preload started first,
    then the app's imports), with synthetic TEE devices made first (timed apart);
    `with_preload=False`: without the preload, every import and the engine's once-only work on
    the start's own path (as before it existed); `pause_collector=False`: the garbage collector
    running through the start (as before it was paused). Every subprocess this process starts
    is noted in `subprocesses.jsonl` beside the settings (when, which thread, the command), and
    the preload's own times in `preload.json` once it has ended."""
    from appliance.boot.collector_pause import CollectorPause

    collector = CollectorPause.begin() if pause_collector else None
    import threading

    from appliance.boot.engine_preload import EnginePreload
    from appliance.config import load_section, settings_from_mapping
    from appliance.engine.engine_settings import EngineSettings
    from tests.appliance.attestation.synthetic_tee import SyntheticCpu, SyntheticGpus, write_policy
    from tests.attestation.cpu.synthetic import SyntheticSnp
    from tests.attestation.gpu.synthetic import synthetic_gpu_setup

    # The synthetic devices first, timed apart: the preload starts only after them, so that
    # none of its work hides in the time taken out.
    devices_started_s = time.time()
    work = config.parent
    devices = Path(tempfile.mkdtemp(prefix="devices-", dir=work))
    gpus = synthetic_gpu_setup(devices / "gpu", num_gpus=1)
    snp = SyntheticSnp.create()
    policy = write_policy(
        devices / "policy.toml", {"gpu": gpus.policy_table(), "snp": snp.policy_table()}
    )
    tee = {
        "mode": "required",
        "policy_file": str(policy),
        "gpu_rims_dir": str(gpus.rim_dir),
        "gpu_roots_dir": str(gpus.roots_dir),
        "cpu_trust_dir": str(snp.write_trust_directory(devices / "cpu-trust")),
    }
    devices_s = time.time() - devices_started_s

    _note_subprocesses(work / "subprocesses.jsonl", since_s=spawned_s)
    preload = None
    if with_preload:
        preload = EnginePreload.start(load_section(config, EngineSettings))
        threading.Thread(target=_note_preload, args=(preload, work / "preload.json")).start()
    from appliance.app import build
    from appliance.attestation.devices import EvidenceCollection, OfflineVerifier
    from appliance.attestation.service import TeeService
    from appliance.boot.startup import start_audit_log
    from appliance.server import listen
    from appliance.server import serve as serve_app

    imports_s = time.time() - _STARTED_S - devices_s

    with config.open("rb") as f:
        tables = tomllib.load(f)
    settings = settings_from_mapping({**tables, "tee": tee}, base_dir=work)
    gpu_source = SyntheticGpus(gpus)
    if uuid := os.environ.get(_GPU_UUID_VARIABLE):
        gpu_source = _NamedGpus(gpu_source, uuid)
    service = TeeService(
        "required",
        EvidenceCollection(gpu_source, SyntheticCpu(snp)),
        OfflineVerifier(settings.tee),
    )
    audit_started_s = time.time()
    log = start_audit_log(settings)
    audit_s = time.time() - audit_started_s
    build_started_s = time.time()
    app = build(settings, log, tee=service, preload=preload, collector=collector)
    listen_started_s = time.time()
    listener = listen(settings)
    print(
        json.dumps(
            {
                "url": listener.url,
                "python_start_s": _STARTED_S - spawned_s,
                "imports_s": imports_s,
                "synthetic_devices_s": devices_s,
                "audit_open_s": audit_s,
                "app_build_s": listen_started_s - build_started_s,
                "listen_s": time.time() - listen_started_s,
            }
        ),
        flush=True,
    )
    serve_app(settings, app, listener)


def _note_subprocesses(path: Path, since_s: float) -> None:
    """Append a line to `path` for every subprocess this process starts from now on."""
    import threading

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "subprocess.Popen":
            command = args[1] if isinstance(args[1], list | tuple) else [args[1] or args[0]]
            argv = [str(arg) for arg in command][:3]
            line = {"at_s": time.time() - since_s, "thread": threading.current_thread().name}
            with path.open("a") as f:
                f.write(json.dumps({**line, "argv": argv}) + "\n")

    sys.addaudithook(hook)


def _note_preload(preload: Any, path: Path) -> None:
    """Once the preload has ended: its stages' durations (or its error) into `path`."""
    try:
        preload.wait()
        error = None
    except Exception as exc:
        error = str(exc)
    times = {"imports_s": preload.imports_s, "device_s": preload.device_s, "error": error}
    path.write_text(json.dumps(times))


# ---- one run: this process ---------------------------------------------------------------


def run_once(
    config: Path,
    prompt: str,
    env: dict[str, str],
    *,
    with_preload: bool = True,
    pause_collector: bool = True,
) -> dict[str, float]:
    """One serving process, from its start to the first token; the phases (module docstring)."""
    work = config.parent
    for note in ("subprocesses.jsonl", "preload.json"):
        (work / note).unlink(missing_ok=True)
    spawned_s = time.time()
    without = [] if with_preload else ["--without-preload"]
    without += [] if pause_collector else ["--collector-running"]
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(config), "--spawned", repr(spawned_s), *without],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert child.stdout is not None
        info = json.loads(child.stdout.readline())
        url = info["url"]
        deadline_s = time.time() + 600
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except urllib.error.HTTPError as exc:  # 503 while loading; a failed start says why
                health = json.loads(exc.read() or b"{}")
                if health.get("status") == "failed":
                    raise SystemExit(f"the start failed: {health.get('reason')}") from None
            except OSError:
                pass
            if child.poll() is not None:
                raise SystemExit("the server exited before it was ready")
            if time.time() > deadline_s:
                raise SystemExit("the server was not ready within 10 minutes")
            time.sleep(0.01)
        ready_s = time.time()
        token = _token(config)
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200
            json.load(reply)
        first_token_s = time.time()
        graphs_s = _all_graphs_captured(url, config, deadline_s) - ready_s
    finally:
        child.terminate()
        child.wait(timeout=60)
    boot = _boot_entries(config)
    ready = boot["boot.ready"]["details"]
    phases = ready["load_phases_ms"]
    preload = {"imports_s": None, "device_s": None, "error": None}
    if with_preload:
        preload = json.loads((work / "preload.json").read_text())
    if preload["error"] is not None:
        raise SystemExit(f"the preload failed: {preload['error']}")
    wall_s = first_token_s - spawned_s - info["synthetic_devices_s"]
    # The start's own path, in order: each phase waits for the one before it.
    path = {
        "python start": info["python_start_s"],
        "imports (the server's own; torch is imported with the engine)": info["imports_s"],
        "audit open (boot.start)": info["audit_open_s"],
        "attestation (collect, verify, record)": ready["attestation_ms"] / 1000,
        "key release": phases["key_release_ms"] / 1000,
        "waiting for torch (the preload imports it)": phases.get("torch_wait_ms", 0.0) / 1000,
        "decrypt + load": phases["weights_ms"] / 1000,
        "waiting for the preload": phases.get("preload_wait_ms", 0.0) / 1000,
        "warm-up / graph capture (KV pool, profiled step, CUDA graphs)": (
            phases["engine_build_ms"] / 1000
        ),
        "first token (ready -> first token of a request)": first_token_s - ready_s,
    }
    # Beside it, in the preload's thread (appliance.boot.engine_preload).
    background = {
        "preload: torch, Triton, kernels imported (background)": preload["imports_s"] or 0.0,
        "preload: CUDA, cuBLAS, Triton's first launch (background)": preload["device_s"] or 0.0,
    }
    path_s = sum(path.values())
    return {
        **path,
        **background,
        "rest (app build: without the preload, torch's import; listen; /health)": wall_s - path_s,
        **rest_split(
            boot,
            spawned_s + info["synthetic_devices_s"],
            ready_s,
            before_s=info["python_start_s"] + info["imports_s"] + info["audit_open_s"],
            attestation_s=ready["attestation_ms"] / 1000,
            loading_s=sum(phases.values()) / 1000,
            app_build_s=info["app_build_s"],
            listen_s=info["listen_s"],
        ),
        "ready -> every CUDA graph captured (while idle, after the ready)": graphs_s,
        "sum of the phases (the start's path and the background)": (
            wall_s + sum(background.values())
        ),
        "W5 wall: process start -> first token (synthetic devices taken out)": wall_s,
    }


def _subprocesses(work: Path) -> list[dict[str, Any]]:
    notes = work / "subprocesses.jsonl"
    if not notes.exists():
        return []
    return [json.loads(line) for line in notes.read_text().splitlines()]


def _token(config: Path, role: str = "user") -> str:
    from appliance.auth.local_issuer import LocalIssuer
    from appliance.auth.roles import Role
    from appliance.auth.settings import AuthSettings
    from appliance.config import load_section

    issuer = LocalIssuer.from_settings(load_section(config, AuthSettings))
    assert issuer is not None
    return issuer.mint(Role(role), "cold-start", time.time())


def _all_graphs_captured(url: str, config: Path, deadline_s: float) -> float:
    """When /metrics first showed no CUDA graph left to capture (the engine captures them while
    idle once ready: appliance.engine.engine.Engine.capture_pending_graph)."""
    from server_load import pending_graphs  # bench/, this script's directory

    request = urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {_token(config, 'admin')}"}
    )
    while time.time() < deadline_s:
        with urllib.request.urlopen(request, timeout=5) as reply:
            if pending_graphs(reply.read().decode()) == 0:
                return time.time()
        time.sleep(0.01)
    raise SystemExit("the CUDA graphs were not all captured within 10 minutes")


def _boot_entries(config: Path) -> dict[str, dict[str, Any]]:
    """The last run's boot.start, attestation.verdict and boot.ready entries, by action."""
    from appliance.boot.audit_log import open_audit_log
    from appliance.config import AuditSettings, load_section

    with open_audit_log(load_section(config, AuditSettings)) as log:
        entries = [json.loads(leaf) for _, leaf in log.store.entries(0, log.store.size() - 1)]
    wanted = ("boot.start", "attestation.verdict", "boot.ready")
    return {action: [e for e in entries if e["action"] == action][-1] for action in wanted}


def _entry_s(entry: dict[str, Any]) -> float:
    """An audit entry's time (RFC 3339, UTC, microseconds), in seconds since the epoch."""
    moment = datetime.datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.replace(tzinfo=datetime.UTC).timestamp()


def rest_split(
    boot: dict[str, dict[str, Any]],
    start_s: float,
    ready_s: float,
    *,
    before_s: float,
    attestation_s: float,
    loading_s: float,
    app_build_s: float,
    listen_s: float,
) -> dict[str, float]:
    """Where "rest" goes, from the times the audit log recorded its boot entries: each interval
    between two of them, less the phases measured inside it. `start_s`: the process's start
    (the synthetic devices' time added, as the wall leaves it out); `ready_s`: /health's first
    200; `before_s`: python start, imports and audit open (boot.start's time is its event's
    making, inside the audit open: a few ms below zero there mean nothing else ran);
    `attestation_s`: boot.ready's `attestation_ms`, which ends after the GPUs' coverage check, a
    little past the verdict's record; `loading_s`: key release, the wait for torch, decrypt +
    load, the preload wait and the engine's build; `app_build_s`, `listen_s`: the app's build
    and the listening socket, within the interval to the verdict."""
    boot_start_s, verdict_s, boot_ready_s = (
        _entry_s(boot[action]) for action in ("boot.start", "attestation.verdict", "boot.ready")
    )
    return {
        "  before boot.start (settings, TEE service)": boot_start_s - start_s - before_s,
        "  boot.start to the verdict, of which:": verdict_s - boot_start_s - attestation_s,
        "    the app's build": app_build_s,
        "    listening (TLS context, socket)": listen_s,
        "  verdict to boot.ready (sealed open, ring, records)": boot_ready_s
        - verdict_s
        - loading_s,
        "  boot.ready to /health 200 (engine thread, poll)": ready_s - boot_ready_s,
    }


def warm_up(work: Path, device: str) -> None:
    from appliance.engine.engine_config import EngineConfig
    from appliance.engine.warmup import warm_up as engine_warm_up

    report = engine_warm_up(
        EngineConfig(
            model_dir=work / "sealed", device=device, max_model_len=8192,
            triton_cache_dir=work / "triton-cache",
        )
    )  # fmt: skip
    print(f"warm-up: Triton compiled {report.compiled} kernels into the cache", flush=True)


def _in_child(function: Callable[..., None], *args: Any) -> None:
    """`function(*args)` in a fresh process of its own (spawned, not forked: no CUDA state is
    shared), so that this one never holds GPU memory the served engine would then lack."""
    child = multiprocessing.get_context("spawn").Process(target=function, args=args)
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"{function.__name__} failed (exit status {child.exitcode})")


def _drop_page_cache() -> bool:
    """Drop the page cache (root only); whether it was."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        print(f"the page cache could not be dropped ({exc.strerror}): warm only")
        return False
    return True


def child_env(work: Path, device: str, bytecode: str, *, write: bool = False) -> dict[str, str]:
    """The serving process's environment. `installed`: Python reads compiled bytecode from
    `work/pycache` (PYTHONPYCACHEPREFIX), as an installed appliance reads what pip compiled;
    `write` lets the process fill it (the untimed priming run). `none`: nothing is written and
    no prefix is set, so whatever bytecode the environment has is read, and every other module
    is compiled from source at each start (the GPU machine runs with PYTHONDONTWRITEBYTECODE=1:
    there, all of torch)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if device.startswith("cuda"):
        env[_GPU_UUID_VARIABLE] = gpu_uuid()
    if bytecode == "installed":
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        if write:
            del env["PYTHONDONTWRITEBYTECODE"]
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: tmp)")
    parser.add_argument(
        "--drop-caches", action="store_true", help="drop the page cache before the first run (root)"
    )
    parser.add_argument(
        "--bytecode",
        choices=("installed", "none"),
        default="installed",
        help="installed: an untimed run first writes the bytecode of every module a start "
        "imports, which the timed runs read (what pip's compiled install gives); none: the "
        "environment's own bytecode, the rest compiled from source at each start",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="before each run, one more without the engine's preload (the start as it was)",
    )
    parser.add_argument(
        "--collector-baseline",
        action="store_true",
        help="before each run, one more with the garbage collector running through the start",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--without-preload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--collector-running", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(
            args.serve,
            args.spawned,
            with_preload=not args.without_preload,
            pause_collector=not args.collector_running,
        )
        return
    work = Path(tempfile.mkdtemp(prefix="cold-start-", dir=args.dir))
    shape = LLAMA_31_8B if args.shape == "8b" else TINY
    started = time.time()
    _in_child(write_random_model, work / "plain", shape, args.device)
    manifest_pub = seal(work / "plain", work / "sealed", work / "keys")
    shutil.rmtree(work / "plain")
    config = settings_file(work, args.device, manifest_pub)
    print(f"setup: random {args.shape} model written and sealed in {time.time() - started:.1f} s")
    if args.device.startswith("cuda"):
        # What `inferno warmup` does (the settings above need the synthetic [tee] to load).
        _in_child(warm_up, work, args.device)
    prompt = " ".join(f"t{i}" for i in range(2, 130))
    if args.bytecode == "installed":
        run_once(config, prompt, child_env(work, args.device, args.bytecode, write=True))
        num_files = sum(1 for _ in (work / "pycache").rglob("*.pyc"))
        print(f"bytecode: {num_files} modules compiled into {work / 'pycache'} by an untimed run")
    else:
        print("bytecode: the environment's own; every other module compiles at each start")
    env = child_env(work, args.device, args.bytecode)
    # (with the preload, the collector paused, what the run is), the baselines first.
    variants = [(True, True, "with the preload, the collector paused")]
    if args.baseline:
        variants.insert(0, (False, True, "baseline: no preload"))
    if args.collector_baseline:
        variants.insert(0, (True, False, "baseline: the collector running through the start"))
    for run in range(args.runs):
        for with_preload, pause_collector, what in variants:
            cache = "warm"
            if args.drop_caches and run == 0:
                cache = "cold" if _drop_page_cache() else "warm"
            result = run_once(
                config, prompt, env, with_preload=with_preload, pause_collector=pause_collector
            )
            print(f"run {run + 1} (page cache {cache}, bytecode {args.bytecode}, {what}):")
            for phase, seconds in result.items():
                print(f"  {phase:72s} {seconds:7.3f} s", flush=True)
            spawned = _subprocesses(work)
            print(f"  subprocesses started: {len(spawned)}")
            for note in spawned:
                argv = " ".join(note["argv"])
                print(f"    at {note['at_s']:6.3f} s in {note['thread']}: {argv}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
