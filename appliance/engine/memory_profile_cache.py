"""A measured memory profile, kept for the next build of the same engine on the same GPU model.

Sizing the KV pool (`ModelRunner.kv_pools_for_free_memory`) measures what the largest step and
the CUDA graphs take: a profiled step of max_num_batched_tokens tokens with the most demanding
sampling, then the largest graphs captured. For an 8B model on an H100 that is 0.5-0.7 s of a
sealed start (W5, docs/BENCHMARKS.md, round 11). What it measures depends only on the model's
architecture (its config.json), the engine's settings, the engine's and the kernels' code,
torch, CUDA, Triton and the GPU model: never on the weights' values, nor on what else is on the
GPU, since every figure is growth over what was in use before it.

So a build that measured writes those figures into Triton's kernel cache directory, in a
file named by the SHA-256 of all of that (the key), and a build with the same key reads them
instead of measuring. `inferno warmup` leaves one for the served engine (the offline bundle
ships it with the kernels), and any start that measured leaves one for the next. What is in use
before the pool (weights, CUDA context, other processes) is measured at every build; only the
peaks are kept, and what the measuring steps added to it outside torch's blocks (the kernels
they loaded, cuBLAS's handles), which a build that reads the peaks adds to what it finds in use
(twice, where its process has those already: a smaller pool, never a larger one).

A file that cannot be read, does not parse, names another key or holds a figure outside the
GPU's memory is ignored, with a warning, and the profile measured again. The file is trusted as
the kernels beside it are, by the directory it lives in (the appliance's own, mode 0700 when the
bundle makes it): a compiled kernel there runs on the GPU; a false profile there could size the
KV pool wrongly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from appliance.engine.engine_config import EngineConfig

logger = logging.getLogger(__name__)

FORMAT = "inferno-memory-profile/1"
# A profile file is a few hundred bytes: anything larger is not one.
MAX_FILE_BYTES = 64 << 10
# Settings that change nothing a profile measures: where files are, how much of the GPU the
# pool may take (applied to the live figures), when graphs are captured.
_UNMEASURED_SETTINGS = frozenset(
    {"model_dir", "triton_cache_dir", "gpu_memory_utilization", "capture_graphs_when_idle"}
)


@dataclass(frozen=True, slots=True)
class ProfiledPeaks:
    """What sizing the KV pool measured, in bytes: `MemoryProfile`'s first four figures, and
    how much more of the device was in use after the measuring steps than before them, their
    scratch cache given back (kernels loaded, cuBLAS's handles and workspaces: what a build
    that reads these figures has not run yet, so adds to what it finds in use)."""

    forward_peak: int
    sampling_peak: int
    step_reserved: int
    graph_pool: int
    first_steps_growth: int


class MemoryProfileCache:
    """The profile file of one engine in `directory` (module docstring)."""

    def __init__(self, directory: Path, key: dict[str, Any]) -> None:
        self.key = key
        canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
        name = f"inferno-memory-profile-{hashlib.sha256(canonical.encode()).hexdigest()}.json"
        self.path = Path(directory) / name

    @classmethod
    def for_engine(cls, config: EngineConfig) -> MemoryProfileCache | None:
        """The cache of `config`'s engine on its GPU, in Triton's cache directory; None under
        tensor parallelism (each rank measures its own GPU) and where the model's config.json
        cannot be read (a model built in memory, say): such an engine measures."""
        if config.tensor_parallel_size > 1:
            return None
        try:
            model_config = (Path(config.model_dir) / "config.json").read_bytes()
        except OSError:
            return None
        import torch

        from kernels.backend import triton_cache_dir, triton_version

        device = torch.cuda.get_device_properties(config.torch_device)
        settings = config.model_dump(mode="json", exclude=set(_UNMEASURED_SETTINGS))
        key = {
            "model_config_sha256": hashlib.sha256(model_config).hexdigest(),
            "engine": settings,
            "code_sha256": _code_digest(),
            "gpu": [device.name, device.total_memory, device.major, device.minor],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton_version(),
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        }
        return cls(triton_cache_dir(), key)

    def load(self, device_memory: int) -> ProfiledPeaks | None:
        """The peaks kept for this key, or None (no file: silently; an unusable one: warned)."""
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("memory profile %s unreadable (%s): measuring", self.path, exc.strerror)
            return None
        try:
            return self._parse(data, device_memory)
        except ValueError as exc:
            logger.warning("memory profile %s ignored (%s): measuring", self.path, exc)
            return None

    def store(self, peaks: ProfiledPeaks) -> None:
        """Keep `peaks` for the next build: written whole or not at all (a temporary file
        renamed over the name). A directory that cannot take it is warned about, no more."""
        document = {"format": FORMAT, "key": self.key, "peaks": asdict(peaks)}
        directory = self.path.parent
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=directory, prefix=".inferno-memory-profile-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(document, f, sort_keys=True)
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:
            logger.warning("memory profile not kept in %s: %s", directory, exc.strerror)

    def _parse(self, data: bytes, device_memory: int) -> ProfiledPeaks:
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(document, dict) or set(document) != {"format", "key", "peaks"}:
            raise ValueError("not a memory profile")
        if document["format"] != FORMAT:
            raise ValueError(f"format {document['format']!r}, not {FORMAT!r}")
        if document["key"] != self.key:
            raise ValueError("it was measured for another engine or GPU")
        peaks = document["peaks"]
        names = {field.name for field in fields(ProfiledPeaks)}
        if not isinstance(peaks, dict) or set(peaks) != names:
            raise ValueError(f"its peaks are not {sorted(names)}")
        for name, value in peaks.items():
            if type(value) is not int or not 0 <= value <= device_memory:
                raise ValueError(f"{name} {value!r} is not a byte count within the GPU's memory")
        return ProfiledPeaks(**peaks)


@functools.cache
def _code_digest() -> str:
    """SHA-256 over the engine's and the kernels' source files (path and bytes, in path order):
    any change to the code that runs the profiled step or the graphs makes another key."""
    import kernels

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(kernels.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(f"{package.name}/{path.relative_to(package).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
