"""The GPU's busy fraction over a benchmark's window, from NVML (`nvidia-ml-py`, module
`pynvml`): its utilization, the share of each sample period in which at least one kernel ran,
sampled every 100 ms on a thread. A GPU that is busy nearly all the time sets the pace of what
ran; one that idles waited for its host."""

from __future__ import annotations

import statistics
import threading
from typing import Any


class BusySampler:
    """`with BusySampler(index) as busy: ...`, then `busy.fraction` (NaN without a sample)."""

    def __init__(self, index: int, nvml: Any = None) -> None:
        """index: the GPU's NVML index; nvml: the pynvml module (tests pass a fake)."""
        if nvml is None:
            import pynvml as nvml

        nvml.nvmlInit()
        self._nvml = nvml
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def fraction(self) -> float:
        return statistics.mean(self._samples) / 100 if self._samples else float("nan")
