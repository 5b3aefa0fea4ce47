"""A verification's outcome: every check that ran, passed or not, and the claims it established.

A `Verdict` is the only thing that crosses from verification to key release: a key provider is
called with one and refuses unless `verdict.trusted`. `trusted` is derived, never set: it holds
exactly when at least one check ran and none failed, so an empty verdict is never a pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class Check:
    """One named check (`gpu0.signature`, `snp.policy.debug`), and on failure why it failed."""

    name: str
    passed: bool
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Verdict:
    """The checks of one verification at `at` (the validation time, timezone-aware UTC), and the
    claims (versions, measurements, TCB levels) read from evidence that passed its signature
    checks. Claims are JSON-ready values."""

    checks: tuple[Check, ...]
    at: datetime
    claims: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.at.tzinfo is None:
            raise ValueError("a verdict's validation time must be timezone-aware")

    @property
    def trusted(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(check for check in self.checks if not check.passed)

    @classmethod
    def combine(cls, parts: Iterable[tuple[str, Verdict]], at: datetime) -> Verdict:
        """One verdict of several (`("gpu", gpu_verdict), ("cpu", cpu_verdict)`): the checks of
        all, each claim set under its part's name. Trusted only if every part is."""
        parts = list(parts)
        return cls(
            checks=tuple(check for _, verdict in parts for check in verdict.checks),
            at=at,
            claims={name: dict(verdict.claims) for name, verdict in parts},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "result": "trusted" if self.trusted else "not trusted",
            "at": self.at.isoformat().replace("+00:00", "Z"),
            "failed": [check.to_json() for check in self.failures],
            "checks": [check.to_json() for check in self.checks],
            "claims": dict(self.claims),
        }
