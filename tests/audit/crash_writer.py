"""A process that logs request/complete pairs from many threads until it is killed.

Run by test_crash.py: `python crash_writer.py DB_URL KEY_DIR ORIGIN`. After both entries of a
request are stored it prints `responded <request id> <index> <index>`, as a server would answer
only then.
"""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from audit.event import Actor, Outcome, inference_complete, inference_request
from audit.log import AuditLog, AuditLogSettings
from audit.policy import CheckpointPolicy

ACTOR = Actor(issuer="https://idp.test", subject="load", client="crash-test", roles=("user",))


def serve(log: AuditLog, worker: int, lock: threading.Lock) -> None:
    for n in range(1_000_000):
        request_id = f"w{worker}-{n}"
        common = {"actor": ACTOR, "source_address": "127.0.0.1", "request_id": request_id}
        first = log.append(
            inference_request(
                time=datetime.now(UTC), endpoint="/v1/completions", model="m",
                weights_digest="sha256:00", sampling={"max_tokens": 4}, prompt_commitment="c",
                **common,
            )
        )  # fmt: skip
        second = log.append(
            inference_complete(
                time=datetime.now(UTC), outcome=Outcome.SUCCESS, model="m",
                weights_digest="sha256:00", prompt_tokens=3, completion_tokens=4,
                finish_reason="length", latency_ms=1.5, prompt_commitment="c",
                response_commitment="r", **common,
            )
        )  # fmt: skip
        with lock:
            sys.stdout.write(f"responded {request_id} {first.index} {second.index}\n")
            sys.stdout.flush()


def main() -> None:
    url, key_dir, origin = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    log = AuditLog.open(
        AuditLogSettings(origin, url, key_dir, CheckpointPolicy(every_entries=50, every_s=0.05))
    )
    lock = threading.Lock()
    threads = [threading.Thread(target=serve, args=(log, w, lock)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
