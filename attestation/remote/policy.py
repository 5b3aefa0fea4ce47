"""The client policy: what an application team accepts of an appliance. One TOML file, the same
`[gpu]` and `[snp]`/`[tdx]` tables as the appliance's own policy (docs/ATTESTATION.md: the
measurements, SNP's or TDX's MRTD and RTMRs, the GPU driver and VBIOS versions), and an
`[appliance]` table:

    [appliance]
    audit_vkeys = ["inferno.example/log+1a2b3c4d+AQ..."]   # required: the logs you accept
    max_verdict_age_s = 3600                                # optional: the standing verdict's

Fail closed: the file's errors are attestation.policy's, and a missing `[appliance]` table, an
empty `audit_vkeys`, an unknown key or an age that is not 1 s to ten years is a PolicyError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation.binding import MAX_AUDIT_VKEY_BYTES
from attestation.cpu.policy import CpuPolicy
from attestation.errors import PolicyError
from attestation.gpu.policy import GpuPolicy
from attestation.policy import policy_table, read_policy_file

_MAX_AGE_S = 10 * 365 * 86400
_KEYS = {"audit_vkeys", "max_verdict_age_s"}


@dataclass(frozen=True, slots=True)
class AppliancePolicy:
    gpu: GpuPolicy
    cpu: CpuPolicy
    audit_vkeys: frozenset[str]
    max_verdict_age_s: int | None = None

    @classmethod
    def from_file(cls, path: Path) -> AppliancePolicy:
        """Raises PolicyError naming the file and what is wrong."""
        return cls.from_tables(read_policy_file(path), str(path))

    @classmethod
    def from_tables(cls, tables: Mapping[str, Any], source: str) -> AppliancePolicy:
        table = policy_table(tables, "appliance", source)
        unknown = set(table) - _KEYS
        if unknown:
            raise PolicyError(f"policy {source} [appliance] has unknown keys {sorted(unknown)}")
        vkeys = table.get("audit_vkeys")
        if (
            not isinstance(vkeys, list)
            or not vkeys
            or not all(isinstance(v, str) and 0 < len(v) <= MAX_AUDIT_VKEY_BYTES for v in vkeys)
        ):
            raise PolicyError(
                f"policy {source} [appliance] audit_vkeys must be a non-empty list of vkeys "
                "(`inferno audit vkey` prints the appliance's): an empty list never passes"
            )
        max_age_s = table.get("max_verdict_age_s")
        if max_age_s is not None and (
            not isinstance(max_age_s, int)
            or isinstance(max_age_s, bool)
            or not 1 <= max_age_s <= _MAX_AGE_S
        ):
            raise PolicyError(
                f"policy {source} appliance.max_verdict_age_s must be 1 to {_MAX_AGE_S} s"
            )
        return cls(
            gpu=GpuPolicy.from_table(policy_table(tables, "gpu", source), source),
            cpu=CpuPolicy.from_tables(tables),
            audit_vkeys=frozenset(vkeys),
            max_verdict_age_s=max_age_s,
        )
