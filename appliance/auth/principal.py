"""Who is calling, as established from a verified token: what every route and audit event
sees of the caller."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.auth.roles import Role
from audit.event import Actor


@dataclass(frozen=True, slots=True)
class Principal:
    issuer: str
    subject: str
    # The OAuth client the token was issued to (`client_id`, `azp` or `appid`), if it says.
    client_id: str | None
    roles: frozenset[Role]
    # The token's `exp`, in seconds since the epoch.
    expires_at: float

    def has_any(self, roles: frozenset[Role]) -> bool:
        return not self.roles.isdisjoint(roles)

    def actor(self) -> Actor:
        """This caller as the audit log records it."""
        return Actor(
            issuer=self.issuer,
            subject=self.subject,
            client=self.client_id,
            roles=tuple(sorted(self.roles)),
        )
