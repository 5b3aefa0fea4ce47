"""`inferno serve` as a process: TLS on a real socket, and SIGTERM draining it."""

from __future__ import annotations

import json
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    url: str
    tls: ssl.SSLContext

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.tls, timeout=60)


@contextmanager
def inferno_serve(
    model_dir: Path, tmp_path: Path, *, drain_timeout_s: float
) -> Iterator[ServeProcess]:
    config = tmp_path / "inferno.toml"
    config.write_text(
        f'[model]\ndir = "{model_dir}"\nname = "m"\n[engine]\nmax_model_len = 1024\n'
        f"[server]\nport = 0\ndrain_timeout_s = {drain_timeout_s}\n"
        '[tls]\ncert_file = "cert.pem"\nkey_file = "key.pem"\nself_signed = true\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = _serving_url(process)
        served = ServeProcess(
            process, url, ssl.create_default_context(cafile=tmp_path / "cert.pem")
        )
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


def _serving_url(process: subprocess.Popen[str]) -> str:
    assert process.stderr is not None
    while line := process.stderr.readline():
        if found := re.search(r"serving m on (https://\S+)", line):
            return found.group(1)
    raise AssertionError(f"the server exited before serving (status {process.wait()})")


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
