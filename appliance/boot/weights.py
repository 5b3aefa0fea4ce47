"""The served model: its engine, and the digest of the weight files it was loaded from.

Every inference audit entry names the weights that answered it by this digest:
`sha256:` and the SHA-256 of a `sha256sum`-style listing of the model directory's
`*.safetensors` files (`<hex>  <name>\\n` per file, sorted by name). Whoever holds the files can
recompute it: `cd DIR && LC_ALL=C sha256sum *.safetensors | sha256sum`.

A sealed model (attestation.sealed) has the same digest as the model it was sealed from: the
listing is made from the plaintext digests in its signed manifest, without decrypting anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.loader import load_model
from appliance.engine.models.sealed_images import SealedImages, StagingRing
from appliance.engine.parallel.sharding import ShardPlan
from appliance.engine.parallel.worker import SealedWeights
from appliance.engine.tokenizer import Tokenizer
from appliance.errors import ModelFilesError
from attestation.sealed import SealedModel
from attestation.sealed.manifest import SealedManifest

if TYPE_CHECKING:
    from appliance.boot.engine_preload import EnginePreload


@dataclass(frozen=True, slots=True)
class LoadedModel:
    engine: Engine
    weights_digest: str
    # The signed manifest a sealed model was decrypted under; None for plain weights.
    sealed_manifest: SealedManifest | None = None
    # How long each phase of the load took, in ms: `weights_ms` (read or decrypt into the
    # model), `preload_wait_ms` (then waiting for the engine's preload to end, when there is
    # one: appliance.boot.engine_preload), `engine_build_ms` (KV pool, profiled step, CUDA
    # graphs); the start-up adds `key_release_ms` and, with a preload, `torch_wait_ms` (the
    # load's thread waiting for the preload's import of torch and the engine).
    phases_ms: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, config: EngineConfig, *, preload: EnginePreload | None = None) -> LoadedModel:
        """Load the engine from `config.model_dir`, then digest the files it read (raises
        EngineError for an unusable model, ModelFilesError for unreadable files, PreloadError
        if `preload`, waited for before the engine's first step, failed)."""
        model_dir = Path(config.model_dir)
        # The clearest errors first, before any heavy load: whether this machine has the
        # device, and the model's config.json.
        device = config.torch_device
        ModelConfig.from_model_dir(model_dir)
        tokenizer = Tokenizer.from_model_dir(model_dir)
        clock = _LoadClock(preload)

        def load_weights(shard: ShardPlan | None) -> CausalLM:
            clock.start()  # after the tensor-parallel workers' start
            model = load_model(
                model_dir,
                dtype=config.torch_dtype,
                device=device,
                ops=config.kernel_ops(),
                shard=shard,
                quantization=config.quantization,
            )
            clock.weights_in()
            return model

        engine = Engine.load(config, tokenizer, load_weights)
        return cls(engine, digest_weights(model_dir), phases_ms=clock.phases_ms())

    def with_phase(self, name: str, milliseconds: float) -> LoadedModel:
        return dataclasses.replace(self, phases_ms={**self.phases_ms, name: milliseconds})

    @classmethod
    def _load_sealed_parallel(
        cls,
        config: EngineConfig,
        sealed: SealedModel,
        data_key: bytes,
        workers: int | None,
        tokenizer: Tokenizer,
        preload: EnginePreload | None,
    ) -> LoadedModel:
        """Under tensor parallelism every rank, this one included, decrypts only the chunks of
        its own part of each tensor on the host and copies just that part to its GPU
        (SealedShardImages): no GPU holds another's plaintext."""
        weights = SealedWeights(sealed, data_key, workers)
        clock = _LoadClock(preload)

        def load_weights(shard: ShardPlan | None) -> CausalLM:
            assert shard is not None, "tensor_parallel_size > 1"
            clock.start()
            model = weights.load(
                dtype=config.torch_dtype,
                device=config.torch_device,
                ops=config.kernel_ops(),
                shard=shard,
                quantization=config.quantization,
            )
            clock.weights_in()
            return model

        engine = Engine.load(config, tokenizer, load_weights, sealed=weights)
        return cls(engine, digest_sealed_weights(sealed), sealed.manifest, clock.phases_ms())

    @classmethod
    def load_sealed(
        cls,
        config: EngineConfig,
        sealed: SealedModel,
        data_key: bytes,
        *,
        workers: int | None,
        ring: StagingRing | None = None,
        preload: EnginePreload | None = None,
    ) -> LoadedModel:
        """Load the engine from an opened sealed model (`config.model_dir` must be its
        directory, whose plain config and tokenizer `SealedModel.open` verified): decrypt each
        weight file with `data_key` in `workers` threads into memory on the engine's device (on
        a GPU through a small ring of pinned chunks), fill the model from it, and let the
        plaintext go. No plaintext weight byte touches the disk. `ring`: a staging ring made
        beforehand (it needs no key: allocate it while attestation runs; pinning costs ~1 s per
        GB). `preload` (appliance.boot.engine_preload) is waited for once the weights are in,
        before the engine's first step. Raises SealedModelError for a wrong key or a tampered
        chunk, EngineError for an unusable model, PreloadError if the preload failed."""
        if Path(config.model_dir).resolve() != sealed.directory.resolve():
            raise ModelFilesError(
                f"model.dir {config.model_dir} is not the sealed directory {sealed.directory}"
            )
        ModelConfig.from_model_dir(sealed.directory)  # the clearest errors first
        device = config.torch_device
        if config.tensor_parallel_size > 1:
            tokenizer = Tokenizer.from_model_dir(sealed.directory)
            return cls._load_sealed_parallel(config, sealed, data_key, workers, tokenizer, preload)
        clock = _LoadClock(preload)
        # Beside the decryption, in threads of their own (both release the GIL): the tokenizer's
        # files are parsed, and the staging ring is pinned while the model is allocated.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as aside:
            tokenizer = aside.submit(Tokenizer.from_model_dir, sealed.directory)
            with SealedImages(sealed, data_key, device, workers=workers, ring=ring) as images:
                images.prepare_in_background()
                model = load_model(
                    sealed.directory,
                    dtype=config.torch_dtype,
                    device=device,
                    ops=config.kernel_ops(),
                    weights=images,
                    quantization=config.quantization,
                )
            clock.weights_in()
            engine = Engine.build(config, model, tokenizer.result())
        return cls(engine, digest_sealed_weights(sealed), sealed.manifest, clock.phases_ms())


class _LoadClock:
    """When a load began, had its weights in and was done waiting for the preload (if any):
    the phases of `LoadedModel.phases_ms`, the engine's build running from then to the call
    of `phases_ms`."""

    def __init__(self, preload: EnginePreload | None):
        self._preload = preload
        self._started_s = self._loaded_s = self._waited_s = time.monotonic()

    def start(self) -> None:
        self._started_s = time.monotonic()

    def weights_in(self) -> None:
        """The weights are in: wait for the preload, whose thread must have left Triton before
        the engine's first step (any error of it is raised here, failing the load)."""
        self._loaded_s = time.monotonic()
        if self._preload is not None:
            self._preload.wait()
        self._waited_s = time.monotonic()

    def phases_ms(self) -> dict[str, float]:
        now = time.monotonic()
        spans = {
            "weights": (self._started_s, self._loaded_s),
            "engine_build": (self._waited_s, now),
        }
        if self._preload is not None:
            spans["preload_wait"] = (self._loaded_s, self._waited_s)
        return {
            f"{name}_ms": round((end - start) * 1000, 3) for name, (start, end) in spans.items()
        }


def digest_sealed_weights(sealed: SealedModel) -> str:
    """The digest of a sealed model's weights, from its signed manifest (module docstring)."""
    return _digest_listing((entry.sha256, entry.name) for entry in sealed.manifest.sealed_files)


def digest_weights(model_dir: Path) -> str:
    """`sha256:<hex>` of the listing of `model_dir`'s weight files (see the module docstring)."""
    files = sorted(model_dir.glob("*.safetensors"), key=lambda path: path.name)
    if not files:
        raise ModelFilesError(f"{model_dir} holds no *.safetensors weight files to digest")
    listing = []
    for path in files:
        try:
            with path.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            raise ModelFilesError(f"cannot read {path} for its digest: {exc.strerror}") from exc
        listing.append((digest, path.name))
    return _digest_listing(listing)


def _digest_listing(listing: Iterable[tuple[str, str]]) -> str:
    """`sha256:` and the SHA-256 of `<hex>  <name>\n` lines sorted by name (sha256sum's format)."""
    lines = [f"{digest}  {name}\n" for digest, name in sorted(listing, key=lambda x: x[1])]
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()
