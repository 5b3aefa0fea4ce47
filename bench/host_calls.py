"""Host time of the per-step CUDA calls the model runner makes around a step, fresh or reused.

Each step uploads its packed inputs and records an event the collecting thread sleeps on
(appliance.engine.packed_inputs, appliance.engine.model_runner). This times, in µs of host time
per call, making those anew every step against reusing them, while the GPU is busy (one long
`torch.cuda._sleep` queued first, as a running step would be), so no call waits for it:

    python bench/host_calls.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch


def host_us(call: Callable[[], object], calls: int) -> float:
    """Median over five rounds of the host time per call, in µs, with the GPU busy."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on an H100
        start = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(rounds)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device("cuda")
    packed = np.arange(64, dtype=np.int32)  # a batch-1 step's inputs are a few dozen words
    pinned = torch.empty(128, dtype=torch.int32, pin_memory=True)[:64]
    on_device = torch.empty(128, dtype=torch.int32, device=device)[:64]
    # A reused event is recorded again only once its last record is done (after the step was
    # collected): each round records events whose records the round before completed.
    events = [torch.cuda.Event(blocking=True) for _ in range(args.calls)]
    for event in events:
        event.record()
    torch.cuda.synchronize()
    next_event = iter(events * 5)

    def fresh_upload() -> None:
        torch.from_numpy(packed).pin_memory().to(device, non_blocking=True)

    def reused_upload() -> None:
        pinned.numpy()[:] = packed
        on_device.copy_(pinned, non_blocking=True)

    def fresh_event() -> None:
        torch.cuda.Event(blocking=True).record()

    def reused_event() -> None:
        next(next_event).record()

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | host µs per call |\n|---|---|")
    for name, call in (
        ("upload: pin a fresh buffer, copy to a fresh device tensor", fresh_upload),
        ("upload: into a reused pinned buffer, copy into a reused device one", reused_upload),
        ("completion event: create a blocking one, record it", fresh_event),
        ("completion event: record a reused one", reused_event),
    ):
        print(f"| {name} | {host_us(call, args.calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
