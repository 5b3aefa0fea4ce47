"""The served model: its engine, and the digest of the weight files it was loaded from.

Every inference audit entry names the weights that answered it by this digest:
`sha256:` and the SHA-256 of a `sha256sum`-style listing of the model directory's
`*.safetensors` files (`<hex>  <name>\\n` per file, sorted by name). Whoever holds the files can
recompute it: `cd DIR && LC_ALL=C sha256sum *.safetensors | sha256sum`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from appliance.engine.engine import Engine, EngineConfig
from appliance.errors import ModelFilesError


@dataclass(frozen=True, slots=True)
class LoadedModel:
    engine: Engine
    weights_digest: str

    @classmethod
    def load(cls, config: EngineConfig) -> LoadedModel:
        """Load the engine from `config.model_dir`, then digest the files it read (raises
        EngineError for an unusable model, ModelFilesError for unreadable files)."""
        engine = Engine.from_config(config)
        return cls(engine, digest_weights(Path(config.model_dir)))


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
        listing.append(f"{digest}  {path.name}\n")
    return "sha256:" + hashlib.sha256("".join(listing).encode()).hexdigest()
