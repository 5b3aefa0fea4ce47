"""A tensor-parallel worker process: one device, one shard, following rank 0's announcements.

Started by `appliance.engine.parallel.group` (spawn: a fresh interpreter, no state inherited
from the server). It joins the process groups, loads its shard of the weights from the model
directory, then runs whatever rank 0 announces until told to stop. It has no scheduler, no
tokenizer and never samples. It exits when rank 0 goes away (closed sockets, or its parent
process gone), and reports why it failed (the error's type and message, never a prompt: the
engine's messages carry none) through `errors` before exiting.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from appliance.engine.engine_settings import EngineSettings
from appliance.engine.kv_cache import KVCacheSpec, KVPools
from appliance.engine.model_runner import ModelRunner
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.loader import Quantization, load_model, parts_of, random_model
from appliance.engine.models.sealed_images import SealedShardImages
from appliance.engine.parallel.sharding import ShardPlan, connect_model
from appliance.engine.parallel.step_broadcast import (
    Channels,
    Op,
    StepBroadcast,
    receive,
    receive_forward,
    receive_hidden,
    utilization,
)
from attestation.sealed import SealedModel
from kernels.backend import kernel_ops_for
from kernels.ops import KernelOps

logger = logging.getLogger(__name__)

# How often a worker checks that the process that started it is still there.
_PARENT_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class SealedWeights:
    """A sealed model whose data key was released to the verdict: each rank decrypts only the
    chunks of its own part (SealedShardImages). The key reaches a worker inside its spec,
    through the pipe that starts it (memory to memory in this VM, never a file)."""

    model: SealedModel
    data_key: bytes = field(repr=False)
    decrypt_workers: int | None = None

    def load(
        self,
        *,
        dtype: torch.dtype,
        device: torch.device,
        ops: KernelOps,
        shard: ShardPlan,
        quantization: Quantization | None,
    ) -> CausalLM:
        layout = ModelConfig.from_model_dir(self.model.directory).family.layout
        with SealedShardImages(
            self.model, self.data_key, parts_of(shard, layout), workers=self.decrypt_workers
        ) as images:
            return load_model(
                self.model.directory,
                dtype=dtype,
                device=device,
                ops=ops,
                weights=images,
                shard=shard,
                quantization=quantization,
            )


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to know, sent once at its start (plain values, picklable)."""

    settings: EngineSettings
    model_dir: str
    rank: int
    size: int
    device: str  # this worker's own device
    dtype: torch.dtype
    max_model_len: int
    num_cpu_threads: int
    rendezvous: str
    step_timeout_s: float
    parent_pid: int
    # Benchmarks of shapes without a checkpoint: the shard's weights are drawn at random.
    random_weights: bool = False
    # A sealed model: the shard is decrypted from it rather than read from model_dir.
    sealed: SealedWeights | None = None


def run_worker(spec: WorkerSpec, errors: Connection) -> None:
    """The worker process's entry point."""
    _exit_with_parent(spec.parent_pid)
    try:
        _serve(spec)
    except BaseException as exc:
        errors.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from exc
    finally:
        errors.close()


def _serve(spec: WorkerSpec) -> None:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.num_cpu_threads)
    channels = Channels.join(spec.rendezvous, spec.rank, spec.size, device, spec.step_timeout_s)
    model_config = ModelConfig.from_model_dir(Path(spec.model_dir))
    plan = ShardPlan.for_model(model_config, spec.rank, spec.size)
    ops = kernel_ops_for(device, triton_cache_dir=spec.settings.triton_cache_dir)
    quantization = spec.settings.quantization
    if spec.sealed is not None:
        model = spec.sealed.load(
            dtype=spec.dtype, device=device, ops=ops, shard=plan, quantization=quantization
        )
    else:
        load = random_model if spec.random_weights else load_model
        model = load(
            Path(spec.model_dir),
            dtype=spec.dtype,
            device=device,
            ops=ops,
            shard=plan,
            quantization=quantization,
        )
    settings = spec.settings
    all_reduce = connect_model(model, plan, channels.data, one_shot=settings.one_shot_all_reduce)
    runner = ModelRunner(
        model,
        settings.block_size,
        device,
        spec.max_model_len,
        peers=StepBroadcast.follower(channels),
    )
    kv_spec = KVCacheSpec.for_model(
        model_config,
        settings.block_size,
        spec.dtype,
        kv_cache_dtype=settings.kv_cache_dtype,
        tensor_parallel_size=spec.size,
    )
    _follow(runner, kv_spec, channels)
    # Leave as rank 0 does after STOP (NCCL's teardown is collective), the graphs that
    # captured its collectives released first.
    runner.release_graphs()
    if all_reduce is not None:
        all_reduce.close()
    dist.destroy_process_group()


def _follow(runner: ModelRunner, kv_spec: KVCacheSpec, channels: Channels) -> None:
    """Run rank 0's announcements, in order, until STOP."""
    hidden_size = runner.model.config.hidden_size
    dtype = runner.model.embed_tokens.weight.dtype
    with torch.inference_mode():
        while True:
            message = receive(channels)
            args = message.args
            if message.op is Op.FORWARD:
                input_ids, positions, meta, state_meta = receive_forward(channels, *args[:5])
                runner.run_model(input_ids, positions, meta, state_meta)
            elif message.op is Op.LOGITS:
                rows = receive_hidden(channels, args[0], hidden_size, dtype)
                runner.model.compute_logits(rows)
            elif message.op is Op.PROFILE:
                runner.kv_pools_for_free_memory(
                    kv_spec,
                    args[0],
                    args[1],
                    utilization(args[2]),
                    graph_batch=args[3],
                    num_window_blocks=args[4],
                )
            elif message.op is Op.ALLOCATE_KV:
                runner.allocate_kv_caches(kv_spec, KVPools(args[0], args[1]))
            elif message.op is Op.ALLOCATE_STATES:
                runner.allocate_recurrent_states(args[0])
            elif message.op is Op.CAPTURE_GRAPHS:
                runner.capture_graphs(args[0])
            else:
                return


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outliving rank 0 would hold its GPU (and its shard of the weights) forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="inferno-tp-parent-watch", daemon=True).start()
