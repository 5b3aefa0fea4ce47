"""Shared fixtures: the embedded SmolLM2 model, converted once per test session, and a real
PostgreSQL server for the audit log's tests."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from appliance.engine.engine import Engine

# No test may reach a model hub: everything loads from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU, Triton kernels run in Triton's interpreter. It is chosen when a kernel is
# defined, so this must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine)")
    for item in items:
        # The marker, not item.keywords: keywords also hold directory names (tests/attestation/gpu).
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from installer.embedded_model import find_embedded_gguf

    return find_embedded_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from appliance.engine.models.gguf_import import import_gguf

    out = tmp_path_factory.mktemp("smollm2")
    return import_gguf(smollm2_gguf, out, show_progress=False)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir: Path) -> Callable[..., Engine]:
    """Builds an engine on the CPU around SmolLM2's weights and tokenizer, loaded once per
    session: `smollm2_engine(max_model_len=512)` takes EngineConfig's fields. Engines share
    the (read-only) weights; each has its own KV cache, scheduler and requests."""
    from appliance.engine.engine import Engine
    from appliance.engine.engine_config import EngineConfig
    from appliance.engine.models.loader import load_model
    from appliance.engine.tokenizer import Tokenizer
    from kernels.backend import kernel_ops_for

    # As Engine.from_config loads them for the CPU.
    model = load_model(smollm2_dir, ops=kernel_ops_for(torch.device("cpu")))
    tokenizer = Tokenizer.from_model_dir(smollm2_dir)

    # The tests run alone on their machine: torch on every CPU is faster there (18% on the
    # engine's tests on 2 CPUs, docs/BENCHMARKS.md) than the appliance's automatic choice,
    # which leaves a CPU to the server. Tests of that choice pass num_cpu_threads themselves.
    all_cpus = len(os.sched_getaffinity(0))

    def build(**overrides: Any) -> Engine:
        config = EngineConfig(model_dir=smollm2_dir, **{"num_cpu_threads": all_cpus, **overrides})
        assert not config.on_gpu and config.torch_dtype == torch.float32, "CPU float32 only"
        return Engine.build(config, model, tokenizer)

    return build


def _postgres_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    # Debian keeps the server binaries off PATH, under the major version.
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]),
    )
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on a unix socket in a temporary directory; yields its URL.

    PostgreSQL refuses to run as root, so under root (as in CI) the cluster runs as the
    `postgres` user that Debian's package creates.
    """
    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    prefix: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="inferno-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data = base / "data"
    run = {"check": True, "capture_output": True, "timeout": 120}
    try:
        subprocess.run(
            [*prefix, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--no-sync"],
            **run,
        )  # fmt: skip
        options = f"-k {base} -c listen_addresses='' -c fsync=off -c max_connections=200"
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-o", options, "-l", str(base / "log"), "-w",
             "start"],
            **run,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        log = (base / "log").read_text() if (base / "log").exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {exc.stderr.decode()}\n{log}") from exc
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={base}"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], check=False)
        shutil.rmtree(base, ignore_errors=True)
