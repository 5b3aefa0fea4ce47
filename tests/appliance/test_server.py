"""`inferno serve` as a process: TLS on a real socket, SIGTERM draining it, its audit log across
a drain and across a kill -9, and `inferno audit` exporting what it logged."""

from __future__ import annotations

import json
import re
import signal
import ssl
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.roles import Role
from appliance.boot.audit_log import audit_log_settings
from appliance.config import load_settings
from audit.encoding import decode_base64
from audit.merkle import hash_leaf
from audit.store import AuditStore

SECRET_PROMPT = "My passport number is X9-QUOKKA-4417."


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    url: str
    tls: ssl.SSLContext
    config: Path
    # Everything the server wrote to stderr, drained by a thread so that it never blocks.
    stderr_lines: list[str] = field(default_factory=list)

    def http(self) -> httpx.Client:
        """A client with a user's token from the server's local issuer."""
        issuer = LocalIssuer.from_settings(load_settings(self.config, environ={}).auth)
        assert issuer is not None
        token = issuer.mint(Role.USER, "test-user", time.time())
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.url, verify=self.tls, timeout=60, headers=headers)


def write_config(model_dir: Path, directory: Path, *, drain_timeout_s: float) -> Path:
    config = directory / "inferno.toml"
    config.write_text(
        f'[model]\ndir = "{model_dir}"\nname = "m"\n[engine]\nmax_model_len = 1024\n'
        f"[server]\nport = 0\ndrain_timeout_s = {drain_timeout_s}\n"
        '[tls]\ncert_file = "cert.pem"\nkey_file = "key.pem"\nself_signed = true\n'
        '[audit]\norigin = "inferno.test/serve"\ndata_dir = "audit"\n'
        '[auth]\nlocal_issuer = "demo"\nlocal_issuer_key_file = "auth/issuer.pem"\n'
        '[log]\nlevel = "DEBUG"\n'
        '[appliance]\nprofile = "development"\n[tee]\nmode = "insecure-dev"\n'
    )
    return config


@contextmanager
def inferno_serve(
    model_dir: Path, tmp_path: Path, *, drain_timeout_s: float
) -> Iterator[ServeProcess]:
    config = write_config(model_dir, tmp_path, drain_timeout_s=drain_timeout_s)
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines: list[str] = []
        url = _serving_url(process, lines)
        tls = ssl.create_default_context(cafile=tmp_path / "cert.pem")
        served = ServeProcess(process, url, tls, config, lines)
        threading.Thread(target=_drain, args=(process.stderr, lines), daemon=True).start()
        with served.http() as http:
            deadline = time.monotonic() + 120
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the model did not load"
                time.sleep(0.1)
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _serving_url(process: subprocess.Popen[str], lines: list[str]) -> str:
    assert process.stderr is not None
    while line := process.stderr.readline():
        lines.append(line)
        if found := re.search(r"serving m on (https://\S+)", line):
            return found.group(1)
    raise AssertionError(f"the server exited before serving (status {process.wait()})")


def _drain(stream: Any, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def _logged(config: Path) -> tuple[list[dict[str, Any]], int | None]:
    """The audit entries and the latest signed size, read from the database alone (opening the
    log would sign what a crash left unsigned)."""
    settings = audit_log_settings(load_settings(config, environ={}).audit)
    store = AuditStore.open(settings.database_url, settings.origin)
    try:
        size = store.size()
        latest = store.latest_checkpoint()
        entries = [json.loads(data) for _, data in store.entries(0, size - 1)]
        return entries, None if latest is None else latest.size
    finally:
        store.close()


def _ending(entries: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    [ending] = [
        e for e in entries if e["request_id"] == request_id and e["action"] == "inference.complete"
    ]
    return ending


def _inferno(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _export_and_verify(config: Path, out: Path, *options: str) -> Path:
    """`inferno audit export` then `python -m audit verify` with `inferno audit vkey`'s key."""
    exported = _inferno("audit", "export", str(out), "--config", str(config), *options)
    assert exported.returncode == 0, exported.stderr
    vkey = _inferno("audit", "vkey", "--config", str(config))
    assert vkey.returncode == 0, vkey.stderr
    assert vkey.stdout.startswith("inferno.test/serve+")
    verified = subprocess.run(
        [sys.executable, "-m", "audit", "verify", str(out), "--vkey", vkey.stdout.strip()],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "OK: every check passed" in verified.stdout
    return out


def _stream_completion(http: httpx.Client, max_tokens: int):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    return http.stream("POST", "/v1/completions", json=body)


@pytest.mark.slow
def test_sigterm_stops_accepting_finishes_requests_in_flight_then_exits(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    with inferno_serve(smollm2_dir, tmp_path, drain_timeout_s=60) as served:
        idle = served.http()
        idle.get("/health")  # leaves an idle keep-alive connection, which must not stall the drain
        with served.http() as http, _stream_completion(http, max_tokens=64) as response:
            events = response.iter_lines()
            first = next(line for line in events if line.startswith("data: "))
            signalled = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError), served.http() as late:
                late.get("/health")
            rest = [line for line in events if line.startswith("data: ")]
        texts = [json.loads(line[6:])["choices"][0] for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]"
        assert texts[-1]["finish_reason"] == "length"
        assert served.process.wait(timeout=30) == -signal.SIGTERM
        # Well inside the 60 s drain timeout: only the request in flight was waited for.
        assert time.monotonic() - signalled < 20
        idle.close()
    entries, signed_size = _logged(served.config)
    assert signed_size == len(entries)  # the final checkpoint, signed after the drain
    ending = _ending(entries, json.loads(first[6:])["id"])
    assert (ending["outcome"], ending["details"]["finish_reason"]) == ("success", "length")
    bundle = _export_and_verify(served.config, tmp_path / "bundle", "--from", "1")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["first_index"] == 1
    exported = [json.loads(line) for line in (bundle / "entries.jsonl").read_text().splitlines()]
    export = exported[manifest["export_entry"] - 1]
    assert export["action"] == "audit.export"
    assert export["actor"]["client"] == "inferno audit export"


@pytest.mark.slow
def test_sigterm_cuts_requests_still_running_at_the_drain_timeout(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    with inferno_serve(smollm2_dir, tmp_path, drain_timeout_s=1) as served:
        received = []
        with served.http() as http, _stream_completion(http, max_tokens=1000) as response:
            lines = response.iter_lines()
            received.append(next(line for line in lines if line.startswith("data: ")))
            signalled = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):  # the stream is cut mid-way
                received.extend(line for line in lines if line.startswith("data: "))
        assert served.process.wait(timeout=30) == -signal.SIGTERM
        assert time.monotonic() - signalled < 10
        assert "data: [DONE]" not in received
        assert len(received) < 1000
    entries, signed_size = _logged(served.config)
    assert signed_size == len(entries)
    ending = _ending(entries, json.loads(received[0][6:])["id"])
    assert ending["outcome"] == "aborted"
    assert 0 < ending["details"]["completion_tokens"] < 1000


@dataclass(frozen=True)
class Answered:
    request_id: str
    index: int
    leaf_hash: bytes


def _load(served: ServeProcess, worker: int, answered: list[Answered], stop: threading.Event):
    """Requests one after another, half of them streamed, until the server dies or `stop`;
    records each request that got its whole response."""
    with served.http() as http:
        for n in range(1_000_000):
            if stop.is_set():
                return
            try:
                if (worker + n) % 2:
                    messages = [{"role": "user", "content": SECRET_PROMPT}]
                    body = {"model": "m", "messages": messages, "max_tokens": 4}
                    response = http.post("/v1/chat/completions", json=body)
                    if response.status_code != 200:
                        return
                    request_id = response.json()["id"]
                else:
                    body = {"model": "m", "prompt": SECRET_PROMPT, "max_tokens": 4,
                            "stream": True}  # fmt: skip
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        lines = [x for x in response.iter_lines() if x.startswith("data: ")]
                    if not lines or lines[-1] != "data: [DONE]":
                        return
                    request_id = json.loads(lines[0][6:])["id"]
            except httpx.HTTPError:
                return  # the server is gone
            _, index, leaf_hash = response.headers["audit-entry"].split(" ")
            answered.append(Answered(request_id, int(index), decode_base64(leaf_hash, "leaf")))


@pytest.mark.slow
def test_kill_9_under_load_keeps_both_entries_of_every_answered_request_and_the_log_verifies(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    answered: list[Answered] = []
    stop = threading.Event()
    with inferno_serve(smollm2_dir, tmp_path, drain_timeout_s=5) as served:
        clients = [
            threading.Thread(target=_load, args=(served, worker, answered, stop))
            for worker in range(8)
        ]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 120
        while len(answered) < 40:
            assert time.monotonic() < deadline, f"only {len(answered)} requests answered"
            time.sleep(0.05)
        served.process.send_signal(signal.SIGKILL)
        served.process.wait()
        stop.set()
        for client in clients:
            client.join(timeout=60)
        killed_stderr = "".join(served.stderr_lines)
    with inferno_serve(smollm2_dir, tmp_path, drain_timeout_s=5) as restarted:
        with restarted.http() as http:
            body = {"model": "m", "prompt": "Hi", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200
        restarted.process.send_signal(signal.SIGTERM)
        assert restarted.process.wait(timeout=60) == -signal.SIGTERM
        restarted_stderr = "".join(restarted.stderr_lines)

    bundle = _export_and_verify(restarted.config, tmp_path / "audit.tar", "--tar")
    with tarfile.open(bundle) as tar:
        raw = tar.extractfile("entries.jsonl").read().splitlines()  # type: ignore[union-attr]
    entries = [json.loads(line) for line in raw]
    ended = {e["request_id"] for e in entries if e["action"] == "inference.complete"}
    for request in answered:
        assert hash_leaf(raw[request.index]) == request.leaf_hash
        assert entries[request.index]["action"] == "inference.request"
        assert entries[request.index]["request_id"] == request.request_id
        assert request.request_id in ended
    assert [e["action"] for e in entries].count("boot.start") == 2
    for stderr in (killed_stderr, restarted_stderr):
        assert "INFO appliance.engine.engine: engine ready" in stderr  # verbose logging
        assert "QUOKKA" not in stderr
