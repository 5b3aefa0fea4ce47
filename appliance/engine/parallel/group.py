"""Rank 0's side of tensor parallelism: the worker processes, their liveness, their end.

`TensorParallelGroup.start` spawns one worker per extra device (appliance.engine.parallel.worker)
and joins the process groups with them; the caller then loads rank 0's shard (`plan`), wires it
(`connect`) and builds its runner with `broadcast` as its peers.

A worker that dies is noticed two ways: its sockets close, which fails the collective rank 0 is
in (gloo: at once); and a watch thread waiting on every worker's process sentinel, which records
the failure (with the worker's own report of its error, if it sent one), logs it, and on GPUs
aborts the NCCL communicators so that a step blocked on the dead rank ends in an error instead of
spinning forever. Every later announcement raises TensorParallelError. The engine thread then
stops on that error, and the server reports the engine stopped (/health 503).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from appliance.engine.engine_config import gpu_ordinals
from appliance.engine.engine_settings import EngineSettings
from appliance.engine.errors import EngineConfigError, TensorParallelError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.parallel.all_reduce import AllReduce
from appliance.engine.parallel.sharding import ShardPlan, connect_model, verify_divisible
from appliance.engine.parallel.step_broadcast import Channels, StepBroadcast
from appliance.engine.parallel.worker import SealedWeights, WorkerSpec, run_worker

logger = logging.getLogger(__name__)

# Every collective step must finish within this (a CPU prefill of a long prompt on a big model
# is the slowest legitimate one); a worker that hangs alive fails the step after it.
STEP_TIMEOUT_S = 600.0
# How often rank 0 looks at the workers while it waits for them to join.
_JOIN_POLL_S = 0.2
# How long stop() waits for the workers to exit on their own before killing them.
_STOP_TIMEOUT_S = 10.0
# The machines here require NCCL's and PyTorch's multicast (NVLink SHARP) off.
_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class TensorParallelGroup:
    def __init__(
        self,
        plan: ShardPlan,
        channels: Channels,
        workers: list[BaseProcess],
        reports: list[Connection],
        rendezvous_dir: Path,
        *,
        one_shot_all_reduce: bool,
    ):
        self.plan = plan
        self._one_shot_all_reduce = one_shot_all_reduce
        self.all_reduce: AllReduce | None = None  # rank 0's, once connected
        self.channels = channels
        self._workers = workers
        self._reports = reports
        self._rendezvous_dir = rendezvous_dir
        self._failure: TensorParallelError | None = None
        self._failure_lock = threading.Lock()
        self._on_failure: list[Callable[[TensorParallelError], None]] = []
        self._closing = threading.Event()
        self._wake_read, self._wake_write = multiprocessing.Pipe(duplex=False)
        self.broadcast = StepBroadcast(channels, leader=True, failure=self.failure)
        self._watch = threading.Thread(target=self._watch_workers, name="inferno-tp-watch")
        self._watch.daemon = True
        self._watch.start()

    @classmethod
    def start(
        cls,
        settings: EngineSettings,
        model_dir: Path,
        *,
        max_model_len: int,
        dtype: torch.dtype,
        num_cpu_threads: int,
        random_weights: bool = False,
        sealed: SealedWeights | None = None,
    ) -> TensorParallelGroup:
        """Spawn workers for ranks 1 .. tensor_parallel_size - 1 and join them. Raises
        EngineConfigError for a split the model or the machine cannot take, TensorParallelError
        when a worker cannot start. `random_weights`: the workers draw their shards at random
        instead of reading the checkpoint (benchmarks); `sealed`: each worker decrypts its own
        part of this sealed model."""
        size = settings.tensor_parallel_size
        verify_divisible(ModelConfig.from_model_dir(model_dir), size)
        devices = rank_devices(torch.device(settings.device), size)
        if dist.is_initialized():
            raise EngineConfigError(
                "this process already runs a tensor-parallel engine; close it first"
            )
        os.environ.update(_MULTICAST_OFF)
        # A collective that times out aborts the communicators and fails the step (2: clean
        # up only), rather than tearing the whole process down (the default, 3): rank 0 is
        # the server, which must stay up to report the stopped engine.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets stay on loopback
        rendezvous_dir = Path(tempfile.mkdtemp(prefix="inferno-tp-"))  # mode 0700
        rendezvous = str(rendezvous_dir / "rendezvous")
        context = multiprocessing.get_context("spawn")
        workers: list[BaseProcess] = []
        reports: list[Connection] = []
        try:
            for rank in range(1, size):
                report_read, report_write = context.Pipe(duplex=False)
                spec = WorkerSpec(
                    settings=EngineSettings(**settings.model_dump(include=_SETTINGS_FIELDS)),
                    model_dir=str(model_dir),
                    rank=rank,
                    size=size,
                    device=str(devices[rank]),
                    dtype=dtype,
                    max_model_len=max_model_len,
                    num_cpu_threads=num_cpu_threads,
                    rendezvous=rendezvous,
                    step_timeout_s=STEP_TIMEOUT_S,
                    parent_pid=os.getpid(),
                    random_weights=random_weights,
                    sealed=sealed,
                )
                worker = context.Process(
                    target=run_worker,
                    args=(spec, report_write),
                    name=f"inferno-tp-rank{rank}",
                    daemon=True,
                )
                worker.start()
                report_write.close()
                workers.append(worker)
                reports.append(report_read)
            channels = _join_watching(workers, rendezvous, size, devices[0])
        except BaseException as exc:
            _kill(workers)
            shutil.rmtree(rendezvous_dir, ignore_errors=True)
            if isinstance(exc, EngineConfigError):
                raise
            raise TensorParallelError(
                f"the {size - 1} tensor-parallel workers did not start: {exc}"
                f"{_reports_text(reports)}"
            ) from exc
        plan = ShardPlan.for_model(ModelConfig.from_model_dir(model_dir), 0, size)
        logger.info("tensor parallelism: %d ranks on %s", size, ", ".join(map(str, devices)))
        return cls(
            plan,
            channels,
            workers,
            reports,
            rendezvous_dir,
            one_shot_all_reduce=settings.one_shot_all_reduce,
        )

    def connect(self, model: CausalLM) -> None:
        """Wire rank 0's loaded shard to the others (its all-reduces and all-gathers)."""
        self.all_reduce = connect_model(
            model, self.plan, self.channels.data, one_shot=self._one_shot_all_reduce
        )

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def fail(self, error: TensorParallelError) -> TensorParallelError:
        """Record that the group is broken (a worker died, or a step timed out on one that
        hangs alive): every later announcement raises the recorded error, the `on_failure`
        callbacks run; `close` kills the workers."""
        with self._failure_lock:
            if self._failure is not None:
                return self._failure
            self._failure = error
            callbacks = list(self._on_failure)
        logger.error("%s", error)
        for callback in callbacks:
            callback(error)
        return error

    def on_failure(self, callback: Callable[[TensorParallelError], None]) -> None:
        """Call `callback(error)` once the group breaks (at once if it has): from the thread
        that notices, typically the watch."""
        with self._failure_lock:
            failure = self._failure
            if failure is None:
                self._on_failure.append(callback)
        if failure is not None:
            callback(failure)

    def failure(self, grace_s: float = 0.0) -> TensorParallelError | None:
        """Why a worker died, if one did; waits up to `grace_s` for the watch to see it."""
        if self._failure is None and grace_s > 0:
            self._watch.join(grace_s)  # the watch ends once it has recorded a death
        return self._failure

    def close(self) -> None:
        """Tell the workers to stop, leave the process groups together with them, wait a
        little, kill any worker that remains.

        NCCL's teardown waits for every rank, and for the CUDA graphs that captured its
        collectives (the engine releases rank 0's first, each worker its own): the workers
        leave as soon as they take the stop, and rank 0 at the same time."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake_write.send_bytes(b"stop")
        if self._failure is None:
            self._send_stop()
        if self.all_reduce is not None:
            self.all_reduce.close()
        _leave_process_groups(polite=self._failure is None)
        for worker in self._workers:
            worker.join(_STOP_TIMEOUT_S)
        _kill(self._workers)
        self._watch.join(_STOP_TIMEOUT_S)
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    def _send_stop(self) -> None:
        """Tell the workers to exit, waiting at most _STOP_TIMEOUT_S for them to take it (a
        broadcast returns only once every worker took it; one still loading or hung would
        hold it): those that did not are killed after."""

        def stop() -> None:
            try:
                self.broadcast.stop()
            except (TensorParallelError, RuntimeError):
                logger.warning("a tensor-parallel worker did not take the stop; killing it")

        sender = threading.Thread(target=stop, name="inferno-tp-stop", daemon=True)
        sender.start()
        sender.join(_STOP_TIMEOUT_S)

    def _watch_workers(self) -> None:
        sentinels = {w.sentinel: (rank, w) for rank, w in enumerate(self._workers, start=1)}
        ready = wait([*sentinels, self._wake_read])
        if self._closing.is_set():
            return
        rank, worker = next(sentinels[s] for s in ready if s in sentinels)
        worker.join(1.0)
        report = _report(self._reports[rank - 1])
        how = (
            f"killed by signal {-worker.exitcode}"
            if worker.exitcode is not None and worker.exitcode < 0
            else f"exited with code {worker.exitcode}"
        )
        self.fail(
            TensorParallelError(
                f"tensor-parallel worker rank {rank} (pid {worker.pid}) {how}"
                f"{f': {report}' if report else ''}; the engine cannot serve without its shard"
            )
        )
        if self.channels.device.type == "cuda":
            _abort_nccl(self.channels.data)


# The settings a worker needs (plain values; the rest stays in the server).
_SETTINGS_FIELDS = {
    "device",
    "dtype",
    "quantization",
    "block_size",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_cuda_graphs",
    "tensor_parallel_size",
    "one_shot_all_reduce",
    "triton_cache_dir",
}


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or cuda:i+r for `device` cuda:i."""
    if device.type != "cuda":
        return [device] * size
    ordinals = gpu_ordinals(str(device), size, torch.cuda.device_count())
    return [torch.device("cuda", ordinal) for ordinal in ordinals]


def _join_watching(
    workers: list[BaseProcess], rendezvous: str, size: int, device: torch.device
) -> Channels:
    """Rank 0 joins the groups while watching the workers: one that dies before joining fails
    the start at once rather than after the rendezvous' timeout."""
    joined: list[Channels] = []
    failed: list[BaseException] = []

    def join() -> None:
        try:
            joined.append(Channels.join(rendezvous, 0, size, device, STEP_TIMEOUT_S))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=join, name="inferno-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_JOIN_POLL_S)
        dead = [w for w in workers if not w.is_alive()]
        if dead and thread.is_alive():
            raise TensorParallelError(f"{dead[0].name} exited with code {dead[0].exitcode}")
    if failed:
        raise failed[0]
    return joined[0]


def _report(connection: Connection) -> str:
    try:
        return str(connection.recv()) if connection.poll(0) else ""
    except (EOFError, OSError):
        return ""


def _reports_text(reports: list[Connection]) -> str:
    texts = [text for text in map(_report, reports) if text]
    return f" ({'; '.join(texts)})" if texts else ""


def _kill(workers: list[BaseProcess]) -> None:
    for worker in workers:
        if worker.is_alive():
            logger.warning("killing tensor-parallel worker %s, still running", worker.name)
            worker.kill()
            worker.join(_STOP_TIMEOUT_S)


def _abort_nccl(group: dist.ProcessGroup) -> None:
    """End every NCCL operation in flight: a collective waiting for a dead rank never returns."""
    from torch.distributed.distributed_c10d import _abort_process_group

    try:
        _abort_process_group(group)
    except Exception:  # the group may already be torn down; the failure is recorded anyway
        logger.exception("aborting the NCCL communicators failed")


def _leave_process_groups(*, polite: bool) -> None:
    """Leave the process groups, waiting at most _STOP_TIMEOUT_S: NCCL's teardown can block
    on a peer that is gone (seen on 2 H200s: `destroy_process_group` never returned after the
    workers exited), and closing an engine must never hang. `polite` is false after a
    failure, when a hang is likelier still; either way a teardown that does not finish in
    time is left to the process's exit."""

    def leave() -> None:
        try:
            dist.destroy_process_group()
        except Exception:
            logger.warning("leaving the tensor-parallel process groups failed", exc_info=True)

    thread = threading.Thread(target=leave, name="inferno-tp-leave", daemon=True)
    thread.start()
    thread.join(_STOP_TIMEOUT_S)
    if thread.is_alive():
        logger.warning(
            "leaving the tensor-parallel process groups did not finish in %.0f s%s; going on",
            _STOP_TIMEOUT_S,
            "" if polite else " after a failure",
        )
