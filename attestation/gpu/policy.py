"""The `[gpu]` table of the attestation policy file, parsed into a frozen `GpuPolicy`.

    [gpu]
    driver_versions = ["550.90.07"]            # required, non-empty
    vbios_versions = ["96.00.9F.00.01"]        # required, non-empty (hex digits, any case)
    num_gpus = [8]                             # required: allowed GPU counts (or one integer)
    architectures = ["HOPPER"]                 # evidence "arch" values (default HOPPER)
    chips = ["GH100"]                          # chip named by the signed device certificate
    boards = ["G520_0200_885"]                 # optional: signed board ids (project_sku_chipsku);
                                               # tells an H200 board from an H100 of one chip
    require_cc_on = true                       # NVML CC state must be "on" (default true)
    require_dev_tools_off = true               # NVML dev-tools mode must be off (default true)
    allowed_mismatch_indices = []              # measurement blocks (1-based) allowed to differ
    expired_rim_certificate = "reject"         # or "accept": an expired RIM signer is noted only
    revocation_accept = ["good"]               # subset of good, stale, unchecked; never revoked
    revocation_max_age_s = 604800              # OCSP/CRL older than this is stale

Fail closed: a missing table, a missing required key, an empty allow-list, an unknown key (a
typo would otherwise silently keep a default) and "revoked" in `revocation_accept` are all
PolicyError. CC and dev-tools mode come from NVML, not from the signed report: when evidence
carries no NVML state and the policy requires it, the check fails as "unknown".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation.errors import PolicyError
from attestation.policy import policy_table, read_policy_file

REVOCATION_STATES = ("good", "revoked", "stale", "unchecked")
_REQUIRED = {"driver_versions", "vbios_versions", "num_gpus"}
_KEYS = _REQUIRED | {
    "architectures",
    "chips",
    "boards",
    "require_cc_on",
    "require_dev_tools_off",
    "allowed_mismatch_indices",
    "expired_rim_certificate",
    "revocation_accept",
    "revocation_max_age_s",
}


@dataclass(frozen=True, slots=True)
class GpuPolicy:
    """What values verified GPU evidence must hold. Build it with `from_table`."""

    driver_versions: frozenset[str]
    vbios_versions: frozenset[str]
    num_gpus: frozenset[int]
    architectures: frozenset[str] = frozenset({"HOPPER"})
    chips: frozenset[str] = frozenset({"GH100"})
    boards: frozenset[str] | None = None  # None: any board of an allowed chip
    require_cc_on: bool = True
    require_dev_tools_off: bool = True
    allowed_mismatch_indices: frozenset[int] = frozenset()
    accept_expired_rim_certificate: bool = False
    revocation_accept: frozenset[str] = frozenset({"good"})
    revocation_max_age_s: int = 7 * 24 * 3600

    @classmethod
    def from_table(cls, table: Mapping[str, Any], source: str = "[gpu]") -> GpuPolicy:
        """Parse a `[gpu]` table. Raises PolicyError naming the key that is wrong."""
        if not isinstance(table, Mapping) or not table:
            raise PolicyError(f"{source}: an empty GPU policy never passes")
        unknown = set(table) - _KEYS
        if unknown:
            raise PolicyError(
                f"{source}: unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})"
            )
        missing = _REQUIRED - set(table)
        if missing:
            raise PolicyError(f"{source}: required keys {sorted(missing)} are missing")
        expired = table.get("expired_rim_certificate", "reject")
        if expired not in ("reject", "accept"):
            raise PolicyError(f"{source}: expired_rim_certificate must be reject or accept")
        revocation = _strings(table, "revocation_accept", ["good"], source)
        if not revocation <= set(REVOCATION_STATES):
            raise PolicyError(
                f"{source}: revocation_accept {sorted(revocation)} names an "
                f"unknown state (states: {REVOCATION_STATES})"
            )
        if "revoked" in revocation:
            raise PolicyError(f"{source}: a revoked certificate is never acceptable")
        max_age = table.get("revocation_max_age_s", 7 * 24 * 3600)
        if not isinstance(max_age, int) or isinstance(max_age, bool) or max_age <= 0:
            raise PolicyError(f"{source}: revocation_max_age_s must be a positive integer")
        return cls(
            driver_versions=_strings(table, "driver_versions", None, source),
            vbios_versions=frozenset(
                v.upper() for v in _strings(table, "vbios_versions", None, source)
            ),
            num_gpus=_counts(table, source),
            architectures=_strings(table, "architectures", ["HOPPER"], source),
            chips=_strings(table, "chips", ["GH100"], source),
            boards=(
                frozenset(b.upper() for b in _strings(table, "boards", None, source))
                if "boards" in table
                else None
            ),
            require_cc_on=_bool(table, "require_cc_on", source),
            require_dev_tools_off=_bool(table, "require_dev_tools_off", source),
            allowed_mismatch_indices=_indices(table, source),
            accept_expired_rim_certificate=expired == "accept",
            revocation_accept=revocation,
            revocation_max_age_s=max_age,
        )

    @classmethod
    def from_file(cls, path: Path) -> GpuPolicy:
        """The `[gpu]` table of the policy file at `path`. Raises PolicyError."""
        return cls.from_table(policy_table(read_policy_file(path), "gpu", path), f"{path} [gpu]")


def _strings(
    table: Mapping[str, Any], key: str, default: list[str] | None, source: str
) -> frozenset[str]:
    value = table.get(key, default)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f"{source}: {key} must be a non-empty list of strings")
    return frozenset(value)


def _counts(table: Mapping[str, Any], source: str) -> frozenset[int]:
    value = table["num_gpus"]
    values = value if isinstance(value, list) else [value]
    if not values or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values
    ):
        raise PolicyError(f"{source}: num_gpus must be a positive integer or a list of them")
    return frozenset(values)


def _indices(table: Mapping[str, Any], source: str) -> frozenset[int]:
    value = table.get("allowed_mismatch_indices", [])
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 255 for v in value
    ):
        raise PolicyError(
            f"{source}: allowed_mismatch_indices must be a list of block indices 1-255"
        )
    return frozenset(value)


def _bool(table: Mapping[str, Any], key: str, source: str) -> bool:
    value = table.get(key, True)
    if not isinstance(value, bool):
        raise PolicyError(f"{source}: {key} must be true or false")
    return value
