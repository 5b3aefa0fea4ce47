"""One-time console sign-in tickets of the local issuer: how an admin signs into the console
where there is no identity provider to sign in with (the demo; break-glass).

`inferno console-link`, run where the appliance runs by someone who can read the local
issuer's key, mints a ticket and prints it inside a link,
`https://HOST:PORT/console/login/local?ticket=...`. The ticket is a JWT signed with the local
issuer's key, of its own audience and type (so it is no API token, and no API token is a
ticket), valid for `TICKET_TTL_S`, with a random id. The console redeems it once into an
ordinary session (`SessionStore.redeem`, which records the id in the same transaction: a second
use is refused, after a restart too).

`verify_console_ticket`:
1. The header names EdDSA, the ticket type and the local issuer's key id.
2. The signature is the local issuer's; `iss`, `aud`, `exp`, `nbf` and `iat` hold (with the
   clock-skew leeway); `sub` and `jti` are there.
3. The ticket lived at most `TICKET_TTL_S` (`exp - iat`): a long-lived "ticket", even one the
   key signed, is refused.
4. Its roles, mapped as the local issuer's tokens' are, include a console role.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import jwt

from appliance.auth.errors import AuthenticationError, AuthorizationError, LoginError
from appliance.auth.local_issuer import (
    LOCAL_ISSUER,
    LOCAL_ROLE_MAPPING,
    MAX_SUBJECT_CHARS,
    LocalIssuer,
)
from appliance.auth.principal import Principal
from appliance.auth.roles import Role

CONSOLE_AUDIENCE = "urn:inferno:console"
TICKET_TYPE = "inferno-console-ticket+jwt"
TICKET_TTL_S = 300
TICKET_CLIENT = "inferno console-link"
# A ticket is a few hundred characters; anything much longer is not one.
MAX_TICKET_CHARS = 2048
CONSOLE_ROLES = frozenset({Role.ADMIN, Role.AUDITOR})


class TicketError(LoginError):
    """A sign-in ticket that is refused; the message says why (never quoting the ticket)."""


@dataclass(frozen=True, slots=True)
class ConsoleTicket:
    ticket_id: str
    principal: Principal

    @property
    def expires_at(self) -> float:
        return self.principal.expires_at


def mint_console_ticket(
    issuer: LocalIssuer, role: Role, subject: str, now: float
) -> tuple[str, ConsoleTicket]:
    """A ticket signing `subject` in with `role` (admin or auditor), and what it says."""
    if role not in CONSOLE_ROLES:
        raise TicketError(f"the console has nothing for the role {role}: use admin or auditor")
    if not subject.strip() or len(subject) > MAX_SUBJECT_CHARS or not subject.isprintable():
        raise TicketError(f"the name must be 1 to {MAX_SUBJECT_CHARS} printable characters")
    issued = int(now)
    ticket = ConsoleTicket(
        secrets.token_urlsafe(16),
        Principal(LOCAL_ISSUER, subject, TICKET_CLIENT, frozenset({role}), issued + TICKET_TTL_S),
    )
    claims = {
        "iss": LOCAL_ISSUER,
        "aud": CONSOLE_AUDIENCE,
        "sub": subject,
        "client_id": TICKET_CLIENT,
        "roles": [role.value],
        "iat": issued,
        "nbf": issued,
        "exp": issued + TICKET_TTL_S,
        "jti": ticket.ticket_id,
    }
    return issuer.sign_jwt(claims, TICKET_TYPE), ticket


def verify_console_ticket(
    issuer: LocalIssuer, text: str, now: float, leeway_s: int
) -> ConsoleTicket:
    """The ticket `text` if it passes the checks of the module docstring; raises TicketError."""
    if len(text) > MAX_TICKET_CHARS:
        raise TicketError("the link holds no sign-in ticket")
    # Step 1.
    try:
        header = jwt.get_unverified_header(text)
    except jwt.PyJWTError:
        raise TicketError("the link holds no sign-in ticket") from None
    if header.get("typ") != TICKET_TYPE or header.get("alg") != "EdDSA":
        raise TicketError("the link's token is not a console sign-in ticket")
    if header.get("kid") != issuer.kid:
        raise TicketError("the ticket is not signed by this appliance's local issuer")
    # Step 2.
    try:
        key = issuer.jwks.key_for(issuer.kid, "EdDSA")
        claims: dict[str, Any] = jwt.decode(
            text,
            key,
            algorithms=["EdDSA"],
            audience=CONSOLE_AUDIENCE,
            issuer=LOCAL_ISSUER,
            leeway=leeway_s,
            options={"require": ["exp", "iat", "nbf", "iss", "aud", "sub", "jti"]},
        )
    except jwt.ExpiredSignatureError:
        raise TicketError(f"the link has expired (links last {TICKET_TTL_S // 60} min)") from None
    except jwt.InvalidAudienceError:
        raise TicketError("the link's token is not a console sign-in ticket") from None
    except jwt.InvalidSignatureError:
        raise TicketError("the ticket is not signed by this appliance's local issuer") from None
    except (jwt.PyJWTError, AuthenticationError):
        raise TicketError("the ticket is malformed or not yet valid") from None
    subject, ticket_id = claims["sub"], claims["jti"]
    # The id is kept in a column of 64 characters (appliance.auth.sessions).
    if (
        not isinstance(subject, str)
        or not isinstance(ticket_id, str)
        or not 0 < len(ticket_id) <= 64
    ):
        raise TicketError("the ticket is malformed")
    # Step 3.
    if not isinstance(claims["iat"], int) or claims["exp"] - claims["iat"] > TICKET_TTL_S:
        raise TicketError(f"the ticket lives longer than {TICKET_TTL_S} s, which no link may")
    # Step 4.
    try:
        roles = LOCAL_ROLE_MAPPING.roles(claims)
    except AuthorizationError as exc:
        raise TicketError(str(exc)) from None
    if not roles & CONSOLE_ROLES:
        raise TicketError("the ticket grants no console role (admin or auditor)")
    client = claims.get("client_id") if isinstance(claims.get("client_id"), str) else None
    principal = Principal(LOCAL_ISSUER, subject, client, roles, float(claims["exp"]))
    return ConsoleTicket(ticket_id, principal)
