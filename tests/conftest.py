"""Shared fixtures: the embedded SmolLM2 model, converted once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
        if "gpu" in item.keywords:
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
