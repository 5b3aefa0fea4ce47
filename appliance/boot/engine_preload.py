"""A process's once-only engine work, done in a background thread while the start-up sequence
opens the audit log, attests and releases the key (docs/ARCHITECTURE.md, "Start-up"; W5 in
docs/BENCHMARKS.md).

A process's first engine pays for more than the engine: importing torch, Triton and the kernels
(seconds), and at the first Triton launch the set-up behind it: the CUDA context, Triton's
driver module, the subprocesses Triton waits for (`ldconfig -p` to find libcuda's directory,
`ptxas --version` for its cache key), cuBLAS, and the modules torch and Triton import lazily on
the way. None of it depends on the key or the weights. `EnginePreload` does it in one thread, in
two stages:

 1. From `start` (the process start, before the audit log opens): the imports, and on a GPU
    Triton's hash of itself (in every kernel's cache key). Nothing in this stage touches a GPU:
    a confidential GPU accepts work only once a passing verdict has set it ready (step 4), and
    a CUDA runtime that failed to start would stay failed.
 2. From `warm_device` (called right after step 4): at once, in a thread of its own, the
    engine's GPU's primary context through CUDA's driver (appliance.boot.cuda_driver: 0.14-0.17 s
    on the H100, while torch may still be importing); once stage 1 is done, torch's CUDA on the
    engine's device, one cuBLAS matmul, and one launch of a kernel the engine's first step runs
    (the RMSNorm of one token of the model's width and dtype: a variant `inferno warmup` puts in
    Triton's cache, so nothing compiles). Meanwhile the start-up thread releases the key and
    decrypts the weights.

The thread is given the engine's settings and config alone: it never sees the data key or a
weight byte, and it runs nothing before step 4 that a failing verdict should have prevented.
`wait` joins it and raises its error (the load fails, and is recorded, like any load error); the
load waits before the engine's first step, so that no two threads are in Triton at once.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field

from appliance.boot import cuda_driver
from appliance.engine.engine_config import EngineConfig, first_gpu_ordinal
from appliance.engine.engine_settings import EngineSettings
from appliance.engine.models.config import ModelConfig
from appliance.errors import BootError


class PreloadError(BootError):
    """The preload thread failed; `wait` raises this, with the thread's error as its cause."""


@dataclass
class EnginePreload:
    """The background thread of the module docstring. `imports_s` and `device_s`: how long each
    stage took, in seconds (None until it ended, or when it did not run)."""

    engine: EngineSettings
    imports_s: float | None = None
    device_s: float | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)
    _context: threading.Thread | None = field(default=None, repr=False)
    _go: threading.Event = field(default_factory=threading.Event, repr=False)
    _config: EngineConfig | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    @classmethod
    def start(cls, engine: EngineSettings) -> EnginePreload:
        """Start stage 1 for an engine of `engine`'s settings (its device, Triton's cache)."""
        preload = cls(engine)
        preload._thread = threading.Thread(target=preload._run, name="engine-preload", daemon=True)
        preload._thread.start()
        return preload

    def warm_device(self, config: EngineConfig) -> None:
        """Let stage 2 run for `config` (once the GPUs it uses are attested and set ready)."""
        self._config = config
        if config.on_gpu:
            self._context = threading.Thread(
                target=self._retain_context,
                args=(first_gpu_ordinal(config.device),),
                name="engine-preload-context",
                daemon=True,
            )
            self._context.start()
        self._go.set()

    def cancel(self) -> None:
        """End after stage 1 (a start that stopped before step 4): stage 2 never runs."""
        self._go.set()

    def wait(self) -> None:
        """Block until the thread has ended; raise PreloadError if it failed."""
        assert self._thread is not None, "started by EnginePreload.start"
        self._thread.join()
        if self._context is not None:
            self._context.join()
        if self._error is not None:
            raise PreloadError(
                f"the engine's preload failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def _run(self) -> None:
        try:
            started_s = time.monotonic()
            self._import_engine()
            self.imports_s = time.monotonic() - started_s
            self._go.wait()
            if self._config is not None and self._config.on_gpu:
                started_s = time.monotonic()
                _warm_device(self._config)
                self.device_s = time.monotonic() - started_s
        except BaseException as exc:  # handed to the start-up thread by wait()
            self._error = exc

    def _retain_context(self, ordinal: int) -> None:
        try:
            cuda_driver.retain_primary_context(ordinal)
        except BaseException as exc:  # handed to the start-up thread by wait()
            self._error = self._error or exc

    def _import_engine(self) -> None:
        importlib.import_module("appliance.boot.weights")  # the load, the engine, torch
        import torch

        from kernels.backend import hash_triton, kernel_ops_for

        # The device's kernels (on a GPU, Triton's: Triton with them, its compiler and driver
        # modules included), Triton pointed at the settings' cache as the engine's config will.
        kernel_ops_for(self.engine.device, triton_cache_dir=self.engine.triton_cache_dir)
        if torch.device(self.engine.device).type == "cuda":
            # Triton's hash of itself, in every kernel's cache key: here beside the server's
            # imports rather than at the engine's first launch.
            hash_triton()


def _warm_device(config: EngineConfig) -> None:
    """Stage 2 of the module docstring, on `config`'s device."""
    import torch

    model = ModelConfig.from_model_dir(config.model_dir)
    device, dtype = config.torch_device, config.torch_dtype
    ops = config.kernel_ops()
    with torch.cuda.device(device):
        # x: [1, hidden]: the first decoder layer's input norm of a one-token step.
        x = torch.zeros(1, model.hidden_size, dtype=dtype, device=device)
        weight = torch.ones(model.hidden_size, dtype=dtype, device=device)
        ops.rms_norm(x, weight, model.rms_norm_eps)
        # cuBLAS loads its libraries and makes its handle at its first matmul; the handle goes
        # back to torch's pool when this thread ends, for the engine's thread to take.
        torch.mm(x, torch.zeros(model.hidden_size, 16, dtype=dtype, device=device))
        torch.cuda.synchronize(device)
