"""Synthetic TEE devices behind the appliance's evidence-source Protocols
(appliance.attestation.evidence), for the boot gate's tests: GPUs of
tests/attestation/gpu/synthetic.py and a SEV-SNP guest of tests/attestation/cpu/synthetic.py,
each able to misbehave in one chosen way; and the attestation policy file a test writes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.attestation.challenge import gpu_nonces
from attestation.cpu import CpuEvidence
from attestation.gpu import GpuEvidence
from tests.attestation.cpu.synthetic import SyntheticSnp
from tests.attestation.gpu.synthetic import SyntheticGpuSetup


@dataclass
class SyntheticGpus:
    """The GpuEvidenceSource of synthetic GPUs; `overrides` change what they report, and
    `replay_challenge` makes them sign the nonces of another challenge (a replayed report)."""

    setup: SyntheticGpuSetup
    overrides: dict[str, Any] = field(default_factory=dict)
    replay_challenge: bytes | None = None
    num_set_ready: int = 0

    def num_gpus(self) -> int:
        return len(self.setup.gpus)

    def collect(self, nonces: Sequence[bytes]) -> Sequence[GpuEvidence]:
        if self.replay_challenge is not None:
            nonces = gpu_nonces(self.replay_challenge, len(nonces))
        return self.setup.collect(nonces, **self.overrides)

    def set_ready(self) -> None:
        self.num_set_ready += 1


@dataclass
class SyntheticCpu:
    """The CpuEvidenceSource of a synthetic SEV-SNP guest; `options` change its report."""

    platform: SyntheticSnp
    options: dict[str, Any] = field(default_factory=dict)

    def collect(self, report_data: bytes) -> CpuEvidence:
        return self.platform.evidence(report_data, **self.options)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def write_policy(path: Path, tables: dict[str, dict[str, Any]]) -> Path:
    """Write `tables` as the TOML policy file at `path` (flat tables, inline sub-tables)."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
