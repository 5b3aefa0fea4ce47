"""Inferno's roles, and how they are read from an identity provider's token claims.

Roles: `user` runs inference; `service` is an application's service account, also for
inference; `admin` manages the appliance and reads its status; `auditor` reads and exports the
audit log. Admin and auditor are separated: no identity may hold both (an admin could otherwise
cover their own tracks), and the API gives admins no audit route (the console shows admins the
log read-only, beside the settings they manage).

Each issuer names claim paths where role values are found (Keycloak `realm_access.roles` or
`resource_access.<client>.roles`, `roles`, `groups`, Entra `roles`, the `scope` string) and which
values grant which role. Nothing is granted by default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from appliance.auth.errors import AuthorizationError


class Role(StrEnum):
    USER = "user"
    SERVICE = "service"
    ADMIN = "admin"
    AUDITOR = "auditor"


SEPARATED_ROLES = frozenset({Role.ADMIN, Role.AUDITOR})
"""No identity may hold all of these at once."""

_SEGMENT = re.compile(r'"([^"]+)"|([^."]+)')


@dataclass(frozen=True, slots=True)
class ClaimPath:
    """A dotted path into the claims: `realm_access.roles`; a segment that itself contains dots
    is quoted: `resource_access."inferno.example.com".roles`."""

    segments: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> ClaimPath:
        segments, position = [], 0
        while True:
            match = _SEGMENT.match(text, position)
            if match is None:
                raise ValueError(
                    f"claim path {text!r} is not dotted names (quote a name that has dots: "
                    'resource_access."my.client".roles)'
                )
            segments.append(match.group(1) or match.group(2))
            position = match.end()
            if position == len(text):
                return cls(tuple(segments))
            if text[position] != ".":
                raise ValueError(f"claim path {text!r}: expected a dot at position {position}")
            position += 1

    def values(self, claims: Mapping[str, Any]) -> frozenset[str]:
        """The string values at this path: a list's strings, or a space-separated string's
        words (as OAuth's `scope`). Anything else (absent, a number, an object) gives none."""
        node: Any = claims
        for segment in self.segments:
            if not isinstance(node, Mapping) or segment not in node:
                return frozenset()
            node = node[segment]
        if isinstance(node, str):
            return frozenset(node.split())
        if isinstance(node, list):
            return frozenset(item for item in node if isinstance(item, str))
        return frozenset()

    def __str__(self) -> str:
        return ".".join(f'"{s}"' if "." in s else s for s in self.segments)


@dataclass(frozen=True, slots=True)
class RoleMapping:
    """Which claim values grant which role, for one issuer."""

    claim_paths: tuple[ClaimPath, ...]
    values: Mapping[Role, frozenset[str]]

    def __post_init__(self) -> None:
        check_separation(self.values)

    def roles(self, claims: Mapping[str, Any]) -> frozenset[Role]:
        """The roles these (verified) claims grant. Raises `AuthorizationError` when they
        grant roles that are kept apart: the identity provider must be fixed, and until then
        the identity gets nothing (fail closed)."""
        found: set[str] = set()
        for path in self.claim_paths:
            found |= path.values(claims)
        granted = frozenset(role for role, values in self.values.items() if values & found)
        if granted >= SEPARATED_ROLES:
            raise AuthorizationError(
                "the token grants both admin and auditor, which are kept apart (separation of "
                "duties); the identity provider must grant one of them"
            )
        return granted


def check_separation(values: Mapping[Role, Iterable[str]]) -> None:
    """Raise `ValueError` if one claim value would grant both admin and auditor."""
    shared = set(values.get(Role.ADMIN, ())) & set(values.get(Role.AUDITOR, ()))
    if shared:
        raise ValueError(
            f"{sorted(shared)} would grant both admin and auditor; these roles are kept apart "
            "(separation of duties): map each value to one of them"
        )
