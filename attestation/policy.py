"""The attestation policy file: one TOML file, one table per verifier (`[gpu]`, `[snp]`,
`[tdx]`), each parsed by its verifier's own policy module into a frozen object.

Fail closed: a missing, unreadable, empty or malformed file is a `PolicyError`, never a pass,
and so is a table a verification needs that the file lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attestation.errors import PolicyError
from attestation.input_limits import MAX_POLICY_BYTES, parse_toml, read_file


def read_policy_file(path: Path) -> Mapping[str, Any]:
    """The parsed tables of the policy file at `path`. Raises PolicyError if it cannot be read,
    is over MAX_POLICY_BYTES, nests deeper than MAX_NESTING_DEPTH (attestation.input_limits),
    is not TOML, or holds no table."""
    data = read_file(path, what="policy file", error=PolicyError, max_bytes=MAX_POLICY_BYTES)
    tables = parse_toml(
        data, what=f"policy file {path}", error=PolicyError, max_bytes=MAX_POLICY_BYTES
    )
    if not tables:
        raise PolicyError(f"policy file {path} is empty: an empty policy never passes")
    return tables


def policy_table(tables: Mapping[str, Any], name: str, source: Path | str) -> Mapping[str, Any]:
    """The `[name]` table of a parsed policy file. Raises PolicyError if it is absent or empty."""
    table = tables.get(name)
    if not isinstance(table, Mapping) or not table:
        raise PolicyError(
            f"policy file {source} has no [{name}] table; {name} evidence is never accepted "
            "without a policy for it"
        )
    return table
