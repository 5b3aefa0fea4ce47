"""W3 of PERFORMANCE.md: online serving through the HTTPS API under Poisson arrivals.

Starts the real server in its own process (TLS on a loopback socket, its audit log in SQLite),
sends streamed `/v1/completions` requests (each its own prompt of --prompt-tokens random token
ids, so the prefix cache never hits: `UniquePrompts`; exactly --output-tokens new tokens: EOS
ignored) arriving as a Poisson process at each rate, and reports
per rate: TTFT and TPOT p50/p99 as the client sees them, output tokens/s, the server process's
CPU time ÷ wall time (all its threads), with the share of its event-loop thread (HTTP, TLS, JSON;
the rest is mostly the engine loop), the same CPU per streamed token, on a GPU its busy
fraction (NVML's utilization: bench/gpu_busy.py; whether the GPU or the host set the pace),
and how long requests
waited for their two audit entries (the server's `inferno:audit_append_seconds`: the accepted
entry delays the first token, the end entry the `[DONE]`), and TTFT as the server measures it
(from the request's arrival at the app: `vllm:time_to_first_token_seconds`) with the engine's
part of it: how long requests queued before they were first scheduled and then took to their
first token (`vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`). The
client's TTFT less the server's is the connection, TLS and the load generator's own delays.
The engine is built as `inferno serve` builds it, so it captures its CUDA graphs once ready:
the runs start after four warm-up requests and once /metrics shows every graph captured.

    python bench/server_load.py [--rates 10,20,40] [--duration-s 60]
        # the random-weight Llama-3.1-8B on the GPU (as bench/gpu_engine.py builds it), served
        # with a numbered word-level tokenizer (token i is the word "w<i>")
    python bench/server_load.py --rates 20,24,28,32 --quantization fp8 --kv-cache-dtype fp8_e4m3
        # the same 8B with FP8 projections (gpu_engine's --quantization fp8) and an FP8 KV
        # cache (engine.quantization and engine.kv_cache_dtype; either flag alone too)
    python bench/server_load.py --rates 20 --profile-engine
        # and where the engine thread's CPU goes at each rate (below)
    python bench/server_load.py --model DIR --device cpu --rates 1 --duration-s 10 \\
        --prompt-tokens 32 --output-tokens 16     # any model directory, e.g. a CPU smoke run
    python bench/server_load.py --stub-model      # no model math: the server's own CPU cost
    python bench/server_load.py --stub-model --stub-step-ms 30 --rates 20
        # the same at the GPU's pace: each step sleeps 30 ms (W3's step at 20 req/s on the
        # H100), so as many requests run at once and each gets one output per step, as there
    python bench/server_load.py --rates 0,10 --console [--repeat 2]
        # the admin console's cost: each rate runs without, then with, one console open

After the rows comes the highest rate the server sustained: the highest of --rates whose every
run had TTFT p99 ≤ 1 s and kept up, meaning that the middle 80% of its requests finished at
least 0.9× as fast as they arrived (`keep_up_ratio`: the span of the 10th to 90th percentile of
arrival times ÷ that of completion times; 1 when the server keeps up, the fraction of the
arrival rate it served when its queue grows). Every request of a run finishes: the run waits
for all of them, and a failed one stops the benchmark. Short runs see only the start of a queue
that grows: the longer --duration-s, the sharper the rule.

With `--profile-engine` (the random 8B or the stub model, which this script serves itself), the
engine thread's `Engine.step` calls are profiled in that thread's CPU time during each rate's
run, and the top functions by own and by cumulative time are printed after its row, with the
engine thread's CPU over the run: whether kernel launches (Triton's `JITFunction.run` and
launcher, torch operations) or the engine's own Python take it. Profiling costs CPU of its
own, more for many small calls: take CPU and latency figures from a run without it. The
profiler is cProfile up to Python 3.11; from 3.12 cProfile hooks every thread at once
(sys.monitoring), which would mix the event loop's calls into the engine's, so there it is the
pure-Python `profile` module, which still hooks one thread, at several times cProfile's cost
per call.

With `--console`, each rate runs twice (or 2 × --repeat times, alternating which goes first):
without a console, and with one console "open": an admin session, made in the server's session
store (the audit database) as a login would, fetches the Overview page and its files once,
then polls `/console/overview/series` at the charts' cadence (the series' interval, waiting
for each answer as the page's script does). Rate 0 is no API load at all: the console's cost
alone. The time series itself is sampled in both runs (the server always samples it).

Prints the device, the commit (INFERNO_COMMIT or git), the model's quantization and KV-cache
dtype, and Markdown rows for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

_HERE = Path(__file__).resolve().parent
RANDOM_MODEL_NAME = "random-llama-3.1-8b"
LOCAL_ISSUER_KEY = "auth/local-issuer.pem"  # beside the server's settings file
STUB_MODEL_NAME = "stub"
# Issue 17's W3: the highest rate the server sustains is the highest with TTFT p99 <= 1 s ...
MAX_SUSTAINED_TTFT_P99_MS = 1000.0
# ... that it also kept up with: the middle 80% of its requests finished at >= 0.9x the rate at
# which they arrived (keep_up_ratio).
MIN_KEEP_UP_RATIO = 0.9


@dataclass(frozen=True, slots=True)
class RequestTiming:
    ttft_s: float
    tpot_s: float
    num_output_tokens: int
    sent_at_s: float  # time.perf_counter() when it was sent, and when its stream ended
    done_at_s: float


# The server process.


def serve_built_model(
    kind: str, config_path: Path, stub_step_s: float = 0.0, profile_engine: bool = False
) -> None:
    """Serve the random-weight 8B (GPU; FP8 projections under `engine.quantization = "fp8"`) or
    the stub model (each forward pass sleeping `stub_step_s`) exactly as `inferno serve` serves
    a model directory. With `profile_engine`, the engine's steps are profiled as the commands on
    stdin say (bench/engine_profile.py)."""
    sys.path.insert(0, str(_HERE))
    from appliance.boot.collector_pause import CollectorPause

    # As `inferno serve`: no cyclic collection until ready, then the start's objects frozen.
    # Without it, every full collection while serving visits all of torch's objects (tens to
    # hundreds of ms with the GIL held), which `inferno serve` never pays.
    with CollectorPause.begin() as collector:
        from appliance.app import build
        from appliance.boot.startup import engine_config, start_audit_log
        from appliance.boot.weights import LoadedModel
        from appliance.config import load_settings
        from appliance.engine.engine import Engine
        from appliance.server import listen, serve

        settings = load_settings(config_path)
        if kind == "random-8b":
            from gpu_engine import random_model  # the same model as W1/W2

            model = random_model(quantization=settings.engine.quantization)
        else:
            from engine_host import stub_model  # model math stubbed out: host cost only

            model = stub_model(stub_step_s)
        tokenizer = numbered_tokenizer(model.config.vocab_size)
        engine = Engine.build(engine_config(settings), model, tokenizer)
        if profile_engine:
            from engine_profile import EngineProfiler

            profiler = EngineProfiler(engine)
            threading.Thread(target=profiler.follow, args=(sys.stdin,), daemon=True).start()
        with start_audit_log(settings) as audit_log:
            # Weights made in memory have no files to digest: the log says so instead.
            loaded = LoadedModel(engine, weights_digest=f"none:{kind}-weights-made-in-memory")
            app = build(settings, audit_log, model=loaded, collector=collector)
            listener = listen(settings)
            print(
                f"inferno: serving {settings.served_model_name} on {listener.url}",
                file=sys.stderr,
            )
            serve(settings, app, listener)


def numbered_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token i is the word " w<i>": every token decodes to text of
    its own, so each generated token is streamed as a chunk, as with a real vocabulary. Spelled
    in GPT-2's byte alphabet ("Ġw<i>") and decoded by its byte-level decoder, as Llama 3's,
    Qwen2's and SmolLM2's vocabularies are, so the engine detokenizes it as it does theirs
    (bytewise: appliance.engine.detokenizer)."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from appliance.engine.tokenizer import Tokenizer

    backend = BackendTokenizer(
        models.WordLevel({f"Ġw{i}": i for i in range(vocab_size)}, unk_token="Ġw0")
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(
        backend, bos_token=None, eos_token=None, add_bos_token=False, chat_template=None
    )


def write_server_files(directory: Path, args: argparse.Namespace) -> tuple[Path, str, int]:
    """The server's settings (and, for the random model, a model directory holding only its
    config.json); returns (settings path, served model name, vocabulary size)."""
    if args.stub_model:
        sys.path.insert(0, str(_HERE))
        from engine_host import STUB_CONFIG

        model_dir = directory / STUB_MODEL_NAME
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(STUB_CONFIG))
        max_model_len: int | None = 4096
    elif args.model is None:
        sys.path.insert(0, str(_HERE))
        from gpu_engine import LLAMA_31_8B, MAX_MODEL_LEN

        model_dir = directory / RANDOM_MODEL_NAME
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
        max_model_len = MAX_MODEL_LEN
    else:
        model_dir = args.model.resolve()
        max_model_len = None
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    engine = {
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.max_decode_burst is not None:
        engine["max_decode_burst"] = args.max_decode_burst
    if args.quantization is not None:
        engine["quantization"] = args.quantization
    if args.async_scheduling is not None:
        engine["async_scheduling"] = args.async_scheduling
    if max_model_len is not None:
        engine["max_model_len"] = max_model_len
    lines = [
        "[model]",
        f"dir = {json.dumps(str(model_dir))}",
        "[engine]",
        *(f"{key} = {json.dumps(value)}" for key, value in engine.items()),
        "[server]",
        'host = "127.0.0.1"',
        "port = 0",
        "max_concurrent_requests = 4096",
        "[tls]",
        'cert_file = "cert.pem"',
        'key_file = "key.pem"',
        "self_signed = true",
        "[audit]",
        'origin = "bench.localhost/audit"',
        'data_dir = "audit"',
        "[auth]",
        'local_issuer = "demo"',
        f"local_issuer_key_file = {json.dumps(LOCAL_ISSUER_KEY)}",
        "[appliance]",
        'profile = "development"',
        "[tee]",
        'mode = "insecure-dev"',
    ]
    config = directory / "inferno.toml"
    config.write_text("\n".join(lines) + "\n")
    return config, model_dir.name, vocab_size


def bench_tokens(directory: Path) -> dict[str, dict[str, str]]:
    """Authorization headers for a `user` and an `admin` (the metrics), signed by the local
    issuer the server's settings enable; its key is made here, before the server starts."""
    from appliance.auth.local_issuer import LocalIssuer
    from appliance.auth.roles import Role

    issuer = LocalIssuer.load_or_create(directory / LOCAL_ISSUER_KEY, token_ttl_s=24 * 3600)
    now = time.time()
    return {
        role: {"Authorization": f"Bearer {issuer.mint(Role(role), 'bench', now)}"}
        for role in ("user", "admin")
    }


def start_server(
    config: Path, built: str | None, stub_step_ms: float = 0.0, profile_engine: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """Start `inferno serve`, or this script serving a `built` model ("random-8b", "stub");
    with `profile_engine` (a built model only), its stdin takes the engine profile's commands
    (`start_engine_profile`, `stop_engine_profile`)."""
    if built is not None:
        command = [sys.executable, __file__, "--serve-built", built, str(config)]
        command += ["--stub-step-ms", str(stub_step_ms)]
        command += ["--profile-engine"] if profile_engine else []
    else:
        command = [sys.executable, "-m", "appliance", "serve", "--config", str(config)]
    stdin = subprocess.PIPE if profile_engine else None
    server = subprocess.Popen(command, stdin=stdin, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    while line := server.stderr.readline():
        sys.stderr.write(line)  # start-up messages, and why it failed if it does
        if found := re.search(r"serving \S+ on (https://\S+)", line):
            # Pass the server's later messages on, so that its pipe never fills and blocks it.
            threading.Thread(
                target=shutil.copyfileobj, args=(server.stderr, sys.stderr), daemon=True
            ).start()
            return server, found.group(1)
    raise SystemExit(f"the server exited before serving (status {server.wait()})")


def gpu_busy(device: str) -> contextlib.AbstractContextManager[Any]:
    """The GPU's busy fraction over a run (bench/gpu_busy.py; the server's GPU, NVML's index 0
    of the machine's one); None on the CPU."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    sys.path.insert(0, str(_HERE))
    from gpu_busy import BusySampler

    return BusySampler(0)


def cpu_s(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a process (all its threads), and of its main thread alone,
    which runs the event loop: HTTP, TLS, JSON (Linux /proc). The rest is mostly the engine
    thread."""

    def read(stat: str) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def start_engine_profile(server: subprocess.Popen[str]) -> None:
    """Profile the server's engine steps from its next step on."""
    assert server.stdin is not None, "start_server(profile_engine=True)"
    server.stdin.write("start\n")
    server.stdin.flush()


async def stop_engine_profile(
    server: subprocess.Popen[str], path: Path, timeout_s: float = 120.0
) -> dict[str, Any]:
    """End the profile (between two engine steps, or at once when idle) and read it back from
    `path`, where the server writes it."""
    sys.path.insert(0, str(_HERE))
    from engine_profile import read_window

    assert server.stdin is not None, "start_server(profile_engine=True)"
    server.stdin.write(f"stop {path}\n")
    server.stdin.flush()
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("the server wrote no engine profile (its messages say why)")
        await asyncio.sleep(0.05)
    return read_window(path)


def print_engine_profile(
    window: dict[str, Any], row: dict[str, float | None], top: int = 25
) -> None:
    """The engine thread's CPU over a rate's run, beside that of the server's threads other
    than the event loop (the engine's, mostly), then its profile's top functions."""
    sys.path.insert(0, str(_HERE))
    from engine_profile import profile_tables

    assert row["server_cpu"] is not None and row["event_loop_cpu"] is not None
    assert row["wall_s"] is not None
    others_s = (row["server_cpu"] - row["event_loop_cpu"]) * row["wall_s"]
    cpu_s = window["engine_thread_cpu_s"]
    num_steps, steps_s = window["num_steps"], window["steps_cpu_s"]
    print(f"\nengine thread at {row['rate']:g} req/s, profiled by {window['profiler']}:")
    if cpu_s is None:
        print("no steps")
        return
    print(
        f"{cpu_s:.2f} s of its CPU over the {num_steps} steps of the run, the profiler's cost"
        f" included (the server's threads but the event loop: {others_s:.2f} s); inside the"
        f" steps as the profile times them, the tables' 100%: {steps_s:.2f} s"
        f" ({steps_s / num_steps * 1e3:.2f} ms a step)"
    )
    print(profile_tables(window["stats"], steps_s, top), flush=True)


# The console.


def console_session(config: Path) -> str:
    """A console session id for an admin, made in the session store the server reads (its
    audit database), as a login through the identity provider would make it."""
    from appliance.auth.principal import Principal
    from appliance.auth.roles import Role
    from appliance.auth.sessions import SessionStore
    from appliance.config import load_settings

    settings = load_settings(config)
    auth = settings.auth
    store = SessionStore.open(
        settings.audit.effective_database_url,
        auth.session_idle_timeout_s,
        auth.session_absolute_timeout_s,
        time.time,
    )
    try:
        principal = Principal(
            "urn:inferno:bench", "bench-console", None, frozenset({Role.ADMIN}), time.time() + 86400
        )
        return store.create(principal, "bench").id
    finally:
        store.close()


@dataclass
class ConsoleViewer:
    """One open Overview: the page and its files once, then the series polled at the charts'
    cadence until `stop` is set. `poll_s` holds each poll's time, as the page waits for it."""

    session_id: str
    ready: asyncio.Event
    stop: asyncio.Event
    poll_s: list[float]

    async def run(self, url: str, tls: ssl.SSLContext) -> None:
        from appliance.auth.sessions import SESSION_COOKIE

        headers = {"Cookie": f"{SESSION_COOKIE}={self.session_id}"}
        # A poll every 5 s outlives the server's 5 s keep-alive as often as not: like a
        # browser, the viewer then opens a new TLS connection (and never sends on one the
        # server is closing, which keep-alive at 5 s would race).
        limits = httpx.Limits(keepalive_expiry=2.0)
        async with httpx.AsyncClient(
            base_url=url, verify=tls, headers=headers, limits=limits, timeout=60
        ) as client:
            for path in ("/console/", "/console/static/console.css",
                         "/console/static/console.js", "/console/static/overview.js"):  # fmt: skip
                (await client.get(path)).raise_for_status()
            known: dict[str, str] = {}  # the series and its last point, as the page holds them
            while not self.stop.is_set():
                started = time.perf_counter()
                answer = await client.get("/console/overview/series", params=known)
                answer.raise_for_status()
                body = answer.json()
                if known:
                    self.poll_s.append(time.perf_counter() - started)
                known = {"series": body["series_id"], "after": str(body["last_seq"])}
                self.ready.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), body["interval_s"])


# The load.


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_tokens: int
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            # Parse only what is needed: a chunk with text, and the closing usage chunk.
            if first is None and line.startswith("data: {") and '"text":""' not in line:
                first = time.perf_counter()
            elif line.startswith("data: {") and '"choices":[]' in line:
                num_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None or num_tokens != output_tokens:
        raise RuntimeError(f"a request produced {num_tokens} tokens, not {output_tokens}")
    tpot = (end - first) / max(num_tokens - 1, 1)
    return RequestTiming(first - start, tpot, num_tokens, start, end)


class UniquePrompts:
    """W3's prompts, each request's its own as distinct users' are: random token ids drawn once
    (a pool of `pool` prompts, handed out in turn), each numbered in its first tokens (base
    `vocab_size`, up to three of them), so no two requests share their first cache block and
    the prefix cache never hits (W4 is the workload that measures it). Cycling the pool as it
    is made every request after its first pass a whole-prompt hit whose prefill cost almost
    nothing (docs/BENCHMARKS.md, issue 17 round 18)."""

    def __init__(self, vocab_size: int, prompt_tokens: int, seed: int, pool: int = 256):
        generator = random.Random(seed)
        self._pool = [
            [generator.randrange(vocab_size) for _ in range(prompt_tokens)] for _ in range(pool)
        ]
        self._vocab_size = vocab_size
        self.served = 0

    def next(self) -> list[int]:
        prompt = list(self._pool[self.served % len(self._pool)])
        number = self.served
        for i in range(min(3, len(prompt))):
            number, prompt[i] = divmod(number, self._vocab_size)
        self.served += 1
        return prompt


async def run_rate(
    url: str,
    tls: ssl.SSLContext,
    model: str,
    prompts: UniquePrompts,
    rate: float,
    args: argparse.Namespace,
    server_pid: int,
    tokens: dict[str, dict[str, str]],
    console: str | None = None,
) -> dict[str, float | None]:
    """Poisson arrivals at `rate` for `duration_s` (none at rate 0); waits for every request
    to finish. With a `console` session id, one console is open throughout."""
    arrivals = random.Random(args.seed + int(rate * 1000))
    viewer = None
    if console is not None:
        viewer = ConsoleViewer(console, asyncio.Event(), asyncio.Event(), [])
        viewing = asyncio.create_task(viewer.run(url, tls))
        await asyncio.wait(
            [viewing, asyncio.create_task(viewer.ready.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if viewing.done():
            viewing.result()  # the console could not open: say why
    # Idle connections are dropped after 2 s, before the server's 5 s keep-alive timeout: with
    # both at 5 s a request sent on a connection the server is closing fails ("Server
    # disconnected without sending a response"), as the 60 s run at 40 req/s did.
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(
        base_url=url, verify=tls, timeout=None, limits=limits, headers=tokens["user"]
    ) as client:
        scraped_start = await histograms(client, tokens["admin"])
        with gpu_busy(args.device) as busy:
            cpu_start, wall_start = cpu_s(server_pid), time.perf_counter()
            tasks = []
            next_arrival = 0.0 if rate > 0 else args.duration_s
            while next_arrival < args.duration_s:
                delay = wall_start + next_arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                request = one_request(client, model, prompts.next(), args.output_tokens)
                tasks.append(asyncio.create_task(request))
                next_arrival += arrivals.expovariate(rate)
            timings = await asyncio.gather(*tasks)
            # The window is the whole arrival period, however early the last request ended.
            await asyncio.sleep(max(wall_start + args.duration_s - time.perf_counter(), 0))
            wall = time.perf_counter() - wall_start
            cpu_end = cpu_s(server_pid)
        scraped_end = await histograms(client, tokens["admin"])
    if viewer is not None:
        viewer.stop.set()
        await viewing
    ttft = sorted(t.ttft_s for t in timings)
    num_tokens = sum(t.num_output_tokens for t in timings)
    accepted = histogram_ms(scraped_start, scraped_end, AUDIT_APPEND + "inference.request")
    ended = histogram_ms(scraped_start, scraped_end, AUDIT_APPEND + "inference.complete")
    queued = histogram_ms(scraped_start, scraped_end, "vllm:request_queue_time_seconds")
    prefill = histogram_ms(scraped_start, scraped_end, "vllm:request_prefill_time_seconds")
    server_ttft = histogram_ms(scraped_start, scraped_end, "vllm:time_to_first_token_seconds")
    tpot = sorted(t.tpot_s for t in timings)
    polls = sorted(viewer.poll_s) if viewer is not None else []
    return {
        "rate": rate,
        "console": console is not None,
        "requests": len(timings),
        "achieved_rate": len(timings) / args.duration_s,
        "keep_up": keep_up_ratio([t.sent_at_s for t in timings], [t.done_at_s for t in timings]),
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "tpot_p50_ms": ms(percentile(tpot, 50)),
        "tpot_p99_ms": ms(percentile(tpot, 99)),
        "output_tok_s": num_tokens / wall,
        "server_cpu": (cpu_end[0] - cpu_start[0]) / wall,
        "event_loop_cpu": (cpu_end[1] - cpu_start[1]) / wall,
        # CPU per streamed token: comparable across runs whose rates or lengths differ.
        "server_cpu_us_per_token": (cpu_end[0] - cpu_start[0]) / max(num_tokens, 1) * 1e6,
        "event_loop_cpu_us_per_token": (cpu_end[1] - cpu_start[1]) / max(num_tokens, 1) * 1e6,
        "audit_accepted_mean_ms": accepted[0],
        "audit_accepted_p99_ms": accepted[1],
        "audit_end_mean_ms": ended[0],
        "audit_end_p99_ms": ended[1],
        "queue_mean_ms": queued[0],
        "queue_p99_ms": queued[1],
        "prefill_mean_ms": prefill[0],
        "prefill_p99_ms": prefill[1],
        "server_ttft_mean_ms": server_ttft[0],
        "server_ttft_p99_ms": server_ttft[1],
        "console_polls": len(polls),
        "console_poll_p50_ms": ms(percentile(polls, 50)),
        "console_poll_p99_ms": ms(percentile(polls, 99)),
        "gpu_busy": None if busy is None else busy.fraction,
        "wall_s": wall,
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def keep_up_ratio(sent_at_s: list[float], done_at_s: list[float]) -> float | None:
    """How fast a run's requests finished against how fast they arrived: the span from the 10th
    to the 90th percentile of the send times ÷ the same span of the end times (each sorted on
    its own). About 1 when the server keeps up (each request ends about one latency after it
    arrived); the fraction of the arrival rate the server served while its queue grew. The
    requests' own times, not the offered rate, so the Poisson draw's noise cancels; the first and
    last 10% are left out, which meet a filling and a draining server. None for fewer than 10
    requests: too few to tell."""
    if len(sent_at_s) != len(done_at_s):
        raise ValueError("one end time per request")
    if len(sent_at_s) < 10:
        return None
    first, last = len(sent_at_s) // 10, len(sent_at_s) - 1 - len(sent_at_s) // 10
    sent, done = sorted(sent_at_s), sorted(done_at_s)
    return (sent[last] - sent[first]) / (done[last] - done[first])


def why_not_sustained(row: dict[str, float | None]) -> str | None:
    """Why a run's rate does not count as sustained (None: it does): its TTFT p99 is over
    MAX_SUSTAINED_TTFT_P99_MS, or it did not keep up (keep_up_ratio below MIN_KEEP_UP_RATIO, or
    too few requests to tell)."""
    ttft_p99, keep_up = row["ttft_p99_ms"], row["keep_up"]
    if ttft_p99 is None:
        return "no requests"
    reasons = []
    if ttft_p99 > MAX_SUSTAINED_TTFT_P99_MS:
        reasons.append(f"TTFT p99 {ttft_p99:,.0f} ms")
    if keep_up is None:
        reasons.append("too few requests to tell whether it kept up")
    elif keep_up < MIN_KEEP_UP_RATIO:
        reasons.append(f"finished at {keep_up:.2f}× the rate they arrived")
    return ", ".join(reasons) or None


def highest_sustained_rate(rows: list[dict[str, float | None]]) -> float | None:
    """The highest rate all of whose runs were sustained (`why_not_sustained`); None if none."""
    rates = {row["rate"] for row in rows}
    sustained = [
        rate
        for rate in rates
        if all(why_not_sustained(row) is None for row in rows if row["rate"] == rate)
    ]
    return max(sustained, default=None)  # type: ignore[type-var]


def sustained_summary(rows: list[dict[str, float | None]]) -> str:
    """Each run's verdict, then the highest sustained rate, with the rule."""
    verdicts = []
    for row in rows:
        why = why_not_sustained(row)
        keep_up = "—" if row["keep_up"] is None else f"{row['keep_up']:.2f}"
        verdict = "sustained" if why is None else f"not sustained: {why}"
        verdicts.append(f"{row['rate']:g} req/s ({keep_up}): {verdict}")
    best = highest_sustained_rate(rows)
    return (
        f"\nSustained: TTFT p99 ≤ {MAX_SUSTAINED_TTFT_P99_MS:g} ms and kept up (the middle 80% of"
        f" the requests finished at ≥ {MIN_KEEP_UP_RATIO:g}× the rate they arrived: the ratio in"
        " parentheses; every request finished).\n"
        + "\n".join(verdicts)
        + "\nhighest sustained rate: "
        + ("none of these" if best is None else f"{best:g} req/s")
    )


Histogram = dict[str, dict[float, float]]

AUDIT_APPEND = "inferno:audit_append_seconds/"
# The histograms a run reads from /metrics before and after: the audit appends per entry
# action (keyed AUDIT_APPEND + action), and the engine's phases that TTFT is made of.
_SCRAPED = ("inferno:audit_append_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds", "vllm:time_to_first_token_seconds")  # fmt: skip


async def histograms(client: httpx.AsyncClient, admin: dict[str, str]) -> Histogram:
    """The server's `_SCRAPED` histograms, each as its cumulative bucket counts by upper bound
    (inf included) and its sum under the key -1; the audit's one per entry action."""
    from prometheus_client.parser import text_string_to_metric_families

    found: Histogram = {}
    for family in text_string_to_metric_families(
        (await client.get("/metrics", headers=admin)).text
    ):
        if family.name not in _SCRAPED:
            continue
        for sample in family.samples:
            key = family.name
            if "action" in sample.labels:
                key = f"{family.name}/{sample.labels['action']}"
            buckets = found.setdefault(key, {})
            if sample.name.endswith("_bucket"):
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_sum"):
                buckets[-1.0] = sample.value
    return found


def histogram_ms(start: Histogram, end: Histogram, key: str) -> tuple[float | None, float | None]:
    """The mean of `key`'s observations between two scrapes, and the upper bound of the bucket
    that holds their 99th percentile (the histogram knows no finer), in ms; None for none."""
    before, after = start.get(key, {}), end.get(key, {})
    count = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    if count == 0:
        return None, None
    mean = (after[-1.0] - before.get(-1.0, 0.0)) / count
    bounds = sorted(bound for bound in after if bound >= 0)
    p99 = next(b for b in bounds if after[b] - before.get(b, 0.0) >= 0.99 * count)
    return 1e3 * mean, 1e3 * p99


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None of nothing)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * p // 100))
    return sorted_values[int(rank) - 1]


def device_line(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    return "cpu"


def commit() -> str:
    if os.environ.get("INFERNO_COMMIT"):
        return os.environ["INFERNO_COMMIT"]
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


async def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="inferno-w3-") as tmp:
        directory = Path(tmp)
        config, model, vocab_size = write_server_files(directory, args)
        tokens = bench_tokens(directory)
        built = "stub" if args.stub_model else "random-8b" if args.model is None else None
        server, url = start_server(config, built, args.stub_step_ms, args.profile_engine)
        try:
            tls = ssl.create_default_context(cafile=directory / "cert.pem")
            await wait_until_ready(url, tls)
            prompts = UniquePrompts(vocab_size, args.prompt_tokens, args.seed)
            async with httpx.AsyncClient(
                base_url=url, verify=tls, timeout=None, headers=tokens["user"]
            ) as client:
                for _ in range(4):  # warm-up, not measured
                    await one_request(client, model, prompts.next(), args.output_tokens)
                # The steady state: the server captures its CUDA graphs once ready, while idle.
                await wait_for_graphs(client, tokens["admin"])
            print(
                f"date {datetime.date.today()} device {device_line(args.device)} commit {commit()}"
                f" engine.quantization {args.quantization or 'none'}"
                f" engine.kv_cache_dtype {args.kv_cache_dtype}"
                f" engine.max_decode_burst {args.max_decode_burst or 'default'}"
                f"\ncommand: {' '.join(sys.argv)}",
                flush=True,
            )
            console = console_session(config) if args.console else None
            rows = []
            for rate in args.rates:
                for with_console in console_runs(args):
                    if args.profile_engine:
                        start_engine_profile(server)
                    result = await run_rate(
                        url, tls, model, prompts, rate, args, server.pid, tokens,
                        console if with_console else None,
                    )  # fmt: skip
                    print(json.dumps(result), flush=True)
                    if args.profile_engine:
                        # Every request of the run has ended: the engine is idle till the next.
                        path = directory / f"engine-profile-{len(rows)}"
                        print_engine_profile(await stop_engine_profile(server, path), result)
                    rows.append(result)
        finally:
            server.terminate()
            server.wait(timeout=120)
    print_rows(rows, args.console)
    print(sustained_summary(rows))


def console_runs(args: argparse.Namespace) -> list[bool]:
    """Whether each run of a rate has a console open: once without, or with --console
    `--repeat` pairs, alternating which of the pair goes first."""
    if not args.console:
        return [False] * args.repeat
    return [with_console for i in range(args.repeat) for with_console in (i % 2, 1 - i % 2)]


def print_rows(rows: list[dict[str, float | None]], console: bool) -> None:
    def fixed(value: float | None, digits: int) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    def bound(value: float | None) -> str:
        return "—" if value is None else f"{value:g}"

    digits = 1 if console else 0

    header = [
        "req/s (achieved)", "requests", "TTFT p50 / p99", "TPOT p50 / p99", "output tok/s",
        "server CPU (of it, event loop)", "CPU per token (event loop)", "GPU busy",
        "audit wait, accepted / end: mean (p99 ≤)",
        "TTFT in the server / of it in the engine, queued / to first token: mean (p99 ≤)",
    ]  # fmt: skip
    if console:
        header[1:1] = ["console"]
        header.append("series polls, p50 / p99")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        cells = [
            f"{r['rate']:g} ({r['achieved_rate']:.1f})",
            f"{r['requests']}",
            f"{fixed(r['ttft_p50_ms'], 0)} / {fixed(r['ttft_p99_ms'], 0)} ms",
            f"{fixed(r['tpot_p50_ms'], 1)} / {fixed(r['tpot_p99_ms'], 1)} ms",
            f"{r['output_tok_s']:.0f}",
            # With a console, its cost is a small share of a core: one decimal.
            f"{r['server_cpu']:.{digits}%} of a core ({r['event_loop_cpu']:.{digits}%})",
            f"{r['server_cpu_us_per_token']:.0f} µs ({r['event_loop_cpu_us_per_token']:.0f} µs)",
            "—" if r["gpu_busy"] is None else f"{r['gpu_busy']:.0%}",
            f"{fixed(r['audit_accepted_mean_ms'], 1)} ms (≤ {bound(r['audit_accepted_p99_ms'])}) / "
            f"{fixed(r['audit_end_mean_ms'], 1)} ms (≤ {bound(r['audit_end_p99_ms'])})",
            f"{fixed(r['server_ttft_mean_ms'], 0)} ms (≤ {bound(r['server_ttft_p99_ms'])}) / "
            f"{fixed(r['queue_mean_ms'], 0)} ms (≤ {bound(r['queue_p99_ms'])}) / "
            f"{fixed(r['prefill_mean_ms'], 0)} ms (≤ {bound(r['prefill_p99_ms'])})",
        ]
        if console:
            cells[1:1] = ["open" if r["console"] else "none"]
            cells.append(
                f"{r['console_polls']}, {fixed(r['console_poll_p50_ms'], 1)} / "
                f"{fixed(r['console_poll_p99_ms'], 1)} ms"
            )
        print("| " + " | ".join(cells) + " |")
    if console:
        print_console_cost(rows)


def print_console_cost(rows: list[dict[str, float | None]]) -> None:
    """Per rate: the console's cost in server CPU and its effect on TTFT p99 (the means of the
    runs with and without it)."""
    for rate in sorted({r["rate"] for r in rows}):  # type: ignore[type-var]
        runs = [r for r in rows if r["rate"] == rate]
        with_it, without = ([r for r in runs if r["console"] is c] for c in (True, False))
        cpu_with = mean([r["server_cpu"] for r in with_it]) or 0.0
        cpu_without = mean([r["server_cpu"] for r in without]) or 0.0
        line = f"rate {rate:g}: the console costs {100 * (cpu_with - cpu_without):+.1f} % of a core"
        p99_with = mean([r["ttft_p99_ms"] for r in with_it])
        p99_without = mean([r["ttft_p99_ms"] for r in without])
        if p99_with is not None and p99_without:
            change = p99_with / p99_without - 1
            line += f"; TTFT p99 {p99_without:.0f} -> {p99_with:.0f} ms ({change:+.1%})"
        print(line)


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


async def wait_until_ready(url: str, tls: ssl.SSLContext, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, verify=tls) as client:
        while (await client.get("/health")).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not become ready")
            await asyncio.sleep(0.5)


def pending_graphs(metrics: str) -> float | None:
    """The `inferno:cuda_graphs_pending` gauge in a /metrics text (None: not there)."""
    for line in metrics.splitlines():
        if line.startswith("inferno:cuda_graphs_pending{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def wait_for_graphs(
    client: httpx.AsyncClient, admin: dict[str, str], timeout_s: float = 600
) -> None:
    """Until /metrics shows no CUDA graph left to capture (the engine captures them while idle
    once the server is ready: appliance.engine.async_engine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pending_graphs((await client.get("/metrics", headers=admin)).text) == 0:
            return
        if time.monotonic() > deadline:
            raise SystemExit("the server's CUDA graphs were not all captured")
        await asyncio.sleep(0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: random 8B, GPU)")
    parser.add_argument("--device", default=None, help="default: cuda (random 8B) or cpu")
    parser.add_argument("--rates", default="10,20,40", help="request rates, req/s")
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrivals per rate")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--max-decode-burst", type=int, help="engine.max_decode_burst (default: the engine's)"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="engine.async_scheduling; default: the engine's (on for cuda)",
    )
    parser.add_argument(
        "--quantization",
        choices=["fp8"],
        help="engine.quantization: FP8 projections (the random 8B as gpu_engine.py makes it)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8_e4m3"],
        default="auto",
        help="engine.kv_cache_dtype",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--console",
        action="store_true",
        help="run each rate without and with one admin console open (its charts polling)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per rate (with --console: pairs of runs)"
    )
    parser.add_argument(
        "--stub-model",
        action="store_true",
        help="bench/engine_host.py's stub model on cpu: the server's own cost, without model math",
    )
    parser.add_argument(
        "--stub-step-ms",
        type=float,
        default=0.0,
        help="with --stub-model: each step also sleeps this long, as on a GPU (W3's pace: 30)",
    )
    parser.add_argument(
        "--profile-engine",
        action="store_true",
        help="profile the engine thread's steps in each run (the random 8B or --stub-model)",
    )
    parser.add_argument("--serve-built", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_built is not None:
        return args
    args.rates = [float(rate) for rate in args.rates.split(",")]
    if any(rate < 0 for rate in args.rates) or args.repeat < 1:
        parser.error("rates must be 0 or more, --repeat 1 or more")
    if args.stub_model and args.quantization is not None:
        parser.error("--quantization: the stub model has no projections worth quantizing")
    if args.profile_engine and args.model is not None:
        parser.error(
            "--profile-engine profiles a model this script serves itself: the random 8B or "
            "--stub-model, not --model"
        )
    if args.device is None:
        args.device = "cuda" if args.model is None and not args.stub_model else "cpu"
    return args


def main() -> None:
    args = parse_args()
    if args.serve_built is not None:
        kind, config = args.serve_built
        serve_built_model(kind, Path(config), args.stub_step_ms / 1e3, args.profile_engine)
        return
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
