"""The attestation policy file: one TOML file, one table per verifier (`[gpu]`, `[snp]`,
`[tdx]`), each parsed by its verifier's own policy module into a frozen object.

Fail closed: a missing, unreadable, empty or malformed file is a `PolicyError`, never a pass,
and so is a table a verification needs that the file lacks.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attestation.errors import PolicyError


def read_policy_file(path: Path) -> Mapping[str, Any]:
    """The parsed tables of the policy file at `path`. Raises PolicyError if it cannot be read,
    is not TOML, or holds no table."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(f"policy file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read policy file {path}: {exc}") from exc
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy file {path} is not valid TOML: {exc}") from exc
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
