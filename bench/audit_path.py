"""The audit log's append throughput through the real request path (the goal: 2,000
entries/s on the 2-core development machine; docs/BENCHMARKS.md).

Starts the real server in its own process, as bench/server_load.py does (TLS on a loopback
socket, its audit log in SQLite with synchronous=FULL), serving bench/engine_host.py's stub
model so that the model costs next to nothing. Then --clients concurrent clients send requests
back to back for --duration-s, each on its own keep-alive TLS connection: `GET /v1/models`
(one `api.request` entry each) or `POST /v1/completions` with one output token (an
`inference.request` and an `inference.complete` entry each). Reports requests/s, entries/s
counted from the `Audit-Entry` positions the server answered with, the server process's CPU,
and how long requests waited for their appends (the server's `inferno:audit_append_seconds`).
The load generator shares the machine's CPUs with the server, so it is a minimal HTTP/1.1
client rather than httpx.

    python bench/audit_path.py [--clients 64] [--duration-s 15] [--route models,completions]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import ssl
import sys
import tempfile
import time
from pathlib import Path

import httpx
from server_load import (
    AUDIT_APPEND,
    bench_tokens,
    commit,
    cpu_s,
    device_line,
    histogram_ms,
    histograms,
    start_server,
    wait_until_ready,
    write_server_files,
)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


class Connection:
    """A minimal HTTP/1.1 keep-alive client over TLS: it sends prepared request bytes and reads
    the status line, headers and Content-Length body, so that the load generator, which shares
    the machine's two CPUs with the server, spends a fraction of what httpx would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str, tls: ssl.SSLContext) -> Connection:
        host, port = url.removeprefix("https://").rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port), ssl=tls))

    async def exchange(self, request: bytes) -> tuple[int, dict[bytes, bytes]]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines)
        await self.reader.readexactly(int(headers[b"content-length"]))
        return int(status_line.split(b" ")[1]), headers

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def prepared_request(route: str, model: str, user: dict[str, str]) -> bytes:
    auth = "".join(f"{name}: {value}\r\n" for name, value in user.items())
    if route == "models":
        return f"GET /v1/models HTTP/1.1\r\nHost: bench\r\n{auth}\r\n".encode()
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "ignore_eos": True})
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


async def client_loop(connection: Connection, request: bytes, until: float, seen: list[int]) -> int:
    """Requests back to back until `until`; appends every answered entry position to `seen`."""
    num_requests = 0
    while time.perf_counter() < until:
        status, headers = await connection.exchange(request)
        if status != 200:
            raise SystemExit(f"the server answered {status}")
        seen.append(int(headers[b"audit-entry"].split(b" ")[1]))
        num_requests += 1
    return num_requests


async def run_route(
    url: str,
    tls: ssl.SSLContext,
    route: str,
    model: str,
    args: argparse.Namespace,
    pid: int,
    tokens: dict[str, dict[str, str]],
) -> dict[str, float | str]:
    connections = [await Connection.open(url, tls) for _ in range(args.clients)]
    request = prepared_request(route, model, tokens["user"])
    async with httpx.AsyncClient(base_url=url, verify=tls) as metrics_client:
        seen: list[int] = []
        audit_start = await histograms(metrics_client, tokens["admin"])
        cpu_start, wall_start = cpu_s(pid), time.perf_counter()
        client_cpu_start = time.process_time()
        until = wall_start + args.duration_s
        counts = await asyncio.gather(
            *(client_loop(connection, request, until, seen) for connection in connections)
        )
        wall = time.perf_counter() - wall_start
        cpu_end = cpu_s(pid)
        client_cpu = (time.process_time() - client_cpu_start) / wall
        audit_end = await histograms(metrics_client, tokens["admin"])
    for connection in connections:
        await connection.close()
    action = "api.request" if route == "models" else "inference.request"
    wait_mean_ms, wait_p99_ms = histogram_ms(audit_start, audit_end, AUDIT_APPEND + action)
    per_request = 1 if route == "models" else 2
    return {
        "route": route,
        "requests_s": sum(counts) / wall,
        # The positions answered span every entry logged meanwhile, the ends of requests too.
        "entries_s": (max(seen) - min(seen) + per_request) / wall,
        "server_cpu": (cpu_end[0] - cpu_start[0]) / wall,
        "event_loop_cpu": (cpu_end[1] - cpu_start[1]) / wall,
        "client_cpu": client_cpu,
        "append_wait_mean_ms": wait_mean_ms,
        "append_wait_p99_ms": wait_p99_ms,
    }


async def measure(args: argparse.Namespace) -> None:
    args.stub_model, args.model, args.device = True, None, "cpu"
    args.max_num_seqs, args.max_num_batched_tokens, args.max_decode_burst = 256, 8192, 1
    args.async_scheduling, args.kv_cache_dtype, args.quantization = None, "auto", None
    with tempfile.TemporaryDirectory(prefix="inferno-audit-") as tmp:
        config, model, _ = write_server_files(Path(tmp), args)
        tokens = bench_tokens(Path(tmp))
        server, url = start_server(config, "stub")
        try:
            tls = ssl.create_default_context(cafile=Path(tmp) / "cert.pem")
            await wait_until_ready(url, tls)
            print(
                f"date {datetime.date.today()} device {device_line('cpu')} commit {commit()}"
                f"\ncommand: {' '.join(sys.argv)}",
                flush=True,
            )
            rows = []
            for route in args.routes:
                row = await run_route(url, tls, route, model, args, server.pid, tokens)
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.terminate()
            server.wait(timeout=120)
    print(
        "\n| route | requests/s | entries/s | server CPU (of it, event loop) | load generator "
        "CPU | append wait mean (p99 ≤) |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['route']} | {r['requests_s']:,.0f} | {r['entries_s']:,.0f} | "
            f"{r['server_cpu']:.0%} of a core ({r['event_loop_cpu']:.0%}) | "
            f"{r['client_cpu']:.0%} | {r['append_wait_mean_ms']:.1f} ms "
            f"(≤ {r['append_wait_p99_ms']:g} ms) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--duration-s", type=float, default=15.0, help="per route")
    parser.add_argument("--routes", default="models,completions", help="models, completions")
    args = parser.parse_args()
    args.routes = args.routes.split(",")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
