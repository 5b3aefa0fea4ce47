"""The audit log's append throughput through the real request path (issue 5's goal: 2,000
entries/s on the 2-core development machine).

Starts the real server in its own process, as bench/server_load.py does (TLS on a loopback
socket, its audit log in SQLite with synchronous=FULL), serving bench/engine_host.py's stub
model so that the model costs next to nothing. Then --clients concurrent clients send requests
back to back for --duration-s: `GET /v1/models` (one `api.request` entry each) or
`POST /v1/completions` with one output token (an `inference.request` and an
`inference.complete` entry each). Reports requests/s, entries/s counted from the `Audit-Entry`
positions the server answered with, the server process's CPU, and how long requests waited for
their appends (the server's `inferno:audit_append_seconds`). The load generator shares the
machine's CPUs with the server.

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
    audit_appends,
    audit_wait_ms,
    commit,
    cpu_s,
    device_line,
    start_server,
    wait_until_ready,
    write_server_files,
)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


async def client_loop(
    client: httpx.AsyncClient, route: str, model: str, until: float, seen: list[int]
) -> int:
    """Requests back to back until `until`; appends every answered entry position to `seen`."""
    num_requests = 0
    while time.perf_counter() < until:
        if route == "models":
            response = await client.get("/v1/models")
        else:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        seen.append(int(response.headers["audit-entry"].split(" ")[1]))
        num_requests += 1
    return num_requests


async def run_route(
    url: str, tls: ssl.SSLContext, route: str, model: str, args: argparse.Namespace, pid: int
) -> dict[str, float | str]:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, verify=tls, timeout=60, limits=limits) as client:
        for _ in range(args.clients):  # open the connections (TLS handshakes) before timing
            await client.get("/v1/models")
        seen: list[int] = []
        audit_start = await audit_appends(client)
        cpu_start, wall_start = cpu_s(pid), time.perf_counter()
        until = wall_start + args.duration_s
        counts = await asyncio.gather(
            *(client_loop(client, route, model, until, seen) for _ in range(args.clients))
        )
        wall = time.perf_counter() - wall_start
        cpu_end = cpu_s(pid)
        audit_end = await audit_appends(client)
    action = "api.request" if route == "models" else "inference.request"
    wait_mean_ms, wait_p99_ms = audit_wait_ms(audit_start, audit_end, action)
    per_request = 1 if route == "models" else 2
    return {
        "route": route,
        "requests_s": sum(counts) / wall,
        # The positions answered span every entry logged meanwhile, the ends of requests too.
        "entries_s": (max(seen) - min(seen) + per_request) / wall,
        "server_cpu": (cpu_end[0] - cpu_start[0]) / wall,
        "event_loop_cpu": (cpu_end[1] - cpu_start[1]) / wall,
        "append_wait_mean_ms": wait_mean_ms,
        "append_wait_p99_ms": wait_p99_ms,
    }


async def measure(args: argparse.Namespace) -> None:
    args.stub_model, args.model, args.device = True, None, "cpu"
    args.max_num_seqs, args.max_num_batched_tokens, args.max_decode_burst = 256, 8192, 1
    with tempfile.TemporaryDirectory(prefix="inferno-audit-") as tmp:
        config, model, _ = write_server_files(Path(tmp), args)
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
                row = await run_route(url, tls, route, model, args, server.pid)
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.terminate()
            server.wait(timeout=120)
    print(
        "\n| route | requests/s | entries/s | server CPU (of it, event loop) | "
        "append wait mean (p99 ≤) |\n|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['route']} | {r['requests_s']:,.0f} | {r['entries_s']:,.0f} | "
            f"{r['server_cpu']:.0%} of a core ({r['event_loop_cpu']:.0%}) | "
            f"{r['append_wait_mean_ms']:.1f} ms (≤ {r['append_wait_p99_ms']:g} ms) |"
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
