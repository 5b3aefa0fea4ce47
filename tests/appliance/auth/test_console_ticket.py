"""One-time console sign-in tickets: what the local issuer mints verifies once, and every
ticket that is expired, forged, of another audience or type, too long-lived, or of no console
role is refused with its reason; a redeemed ticket is refused the second time, after a
restart of the store too."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest

from appliance.auth.console_ticket import (
    CONSOLE_AUDIENCE,
    TICKET_TTL_S,
    TICKET_TYPE,
    TicketError,
    mint_console_ticket,
    verify_console_ticket,
)
from appliance.auth.local_issuer import LOCAL_ISSUER, LocalIssuer
from appliance.auth.roles import Role
from appliance.auth.sessions import SessionStore


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> LocalIssuer:
    return LocalIssuer.load_or_create(tmp_path_factory.mktemp("ticket") / "k.pem", 3600)


def _claims(now: float, **changes: object) -> dict[str, object]:
    issued = int(now)
    claims = {
        "iss": LOCAL_ISSUER, "aud": CONSOLE_AUDIENCE, "sub": "ops", "roles": ["admin"],
        "iat": issued, "nbf": issued, "exp": issued + TICKET_TTL_S, "jti": "ticket-1",
    }  # fmt: skip
    claims.update(changes)
    return {name: value for name, value in claims.items() if value is not None}


def test_a_minted_ticket_verifies_as_the_admin_it_names(issuer: LocalIssuer) -> None:
    now = time.time()
    text, minted = mint_console_ticket(issuer, Role.ADMIN, "ops-alice", now)
    ticket = verify_console_ticket(issuer, text, now + 10, leeway_s=0)
    assert ticket == minted
    principal = ticket.principal
    assert (principal.issuer, principal.subject, principal.roles) == (
        LOCAL_ISSUER, "ops-alice", {Role.ADMIN},
    )  # fmt: skip
    assert ticket.expires_at == int(now) + TICKET_TTL_S


def test_an_expired_ticket_is_refused(issuer: LocalIssuer) -> None:
    text, _ = mint_console_ticket(issuer, Role.ADMIN, "ops", time.time() - TICKET_TTL_S - 120)
    with pytest.raises(TicketError, match="expired"):
        verify_console_ticket(issuer, text, time.time(), leeway_s=60)


def test_a_ticket_of_another_appliance_is_refused(issuer: LocalIssuer, tmp_path: Path) -> None:
    theirs = LocalIssuer.load_or_create(tmp_path / "theirs.pem", 3600)
    text, _ = mint_console_ticket(theirs, Role.ADMIN, "intruder", time.time())
    with pytest.raises(TicketError, match="not signed by this appliance"):
        verify_console_ticket(issuer, text, time.time(), leeway_s=0)


def test_a_ticket_with_a_flipped_signature_bit_is_refused(issuer: LocalIssuer) -> None:
    text, _ = mint_console_ticket(issuer, Role.ADMIN, "ops", time.time())
    head, payload, signature = text.split(".")
    # Flip a bit of the signature's bytes, not of its text: a flipped character can fall
    # outside base64url's alphabet, and the ticket would be refused as malformed instead.
    raw = bytearray(base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)))
    raw[5] ^= 1
    forged = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    with pytest.raises(TicketError, match="not signed by this appliance"):
        verify_console_ticket(issuer, f"{head}.{payload}.{forged}", time.time(), 0)


def test_an_api_token_is_no_ticket(issuer: LocalIssuer) -> None:
    token = issuer.mint(Role.ADMIN, "ops", time.time())
    with pytest.raises(TicketError, match="not a console sign-in ticket"):
        verify_console_ticket(issuer, token, time.time(), leeway_s=0)


def test_a_ticket_of_another_audience_is_refused(issuer: LocalIssuer) -> None:
    text = issuer.sign_jwt(_claims(time.time(), aud="urn:inferno:api"), TICKET_TYPE)
    with pytest.raises(TicketError, match="not a console sign-in ticket"):
        verify_console_ticket(issuer, text, time.time(), leeway_s=0)


def test_a_long_lived_ticket_is_refused_though_the_key_signed_it(issuer: LocalIssuer) -> None:
    now = time.time()
    text = issuer.sign_jwt(_claims(now, exp=int(now) + 86400), TICKET_TYPE)
    with pytest.raises(TicketError, match="lives longer"):
        verify_console_ticket(issuer, text, now, leeway_s=0)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"roles": ["user"]}, "no console role"),
        ({"roles": ["admin", "auditor"]}, "kept apart"),
        ({"jti": None}, "malformed"),
        ({"jti": "x" * 65}, "malformed"),
        ({"iss": "https://idp.example.com"}, "malformed"),
    ],
)
def test_hostile_ticket_claims_are_refused(
    issuer: LocalIssuer, changes: dict[str, object], reason: str
) -> None:
    text = issuer.sign_jwt(_claims(time.time(), **changes), TICKET_TYPE)
    with pytest.raises(TicketError, match=reason):
        verify_console_ticket(issuer, text, time.time(), leeway_s=0)


@pytest.mark.parametrize("text", ["", "not-a-jwt", "a.b.c", "x" * 5000])
def test_garbage_is_no_ticket(issuer: LocalIssuer, text: str) -> None:
    with pytest.raises(TicketError, match="no sign-in ticket"):
        verify_console_ticket(issuer, text, time.time(), leeway_s=0)


def test_minting_refuses_a_role_without_console_pages(issuer: LocalIssuer) -> None:
    with pytest.raises(TicketError, match="nothing for the role user"):
        mint_console_ticket(issuer, Role.USER, "ops", time.time())


def test_a_ticket_is_redeemed_once_even_across_a_restart(
    issuer: LocalIssuer, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'sessions.db'}"
    store = SessionStore.open(url, 900, 28800, time.time)
    text, _ = mint_console_ticket(issuer, Role.ADMIN, "ops", time.time())
    ticket = verify_console_ticket(issuer, text, time.time(), leeway_s=0)
    session = store.redeem(ticket.ticket_id, ticket.expires_at, ticket.principal)
    assert session is not None and store.get(session.id) is not None
    assert session.principal.roles == {Role.ADMIN} and session.id_token == ""
    assert store.redeem(ticket.ticket_id, ticket.expires_at, ticket.principal) is None
    store.close()
    reopened = SessionStore.open(url, 900, 28800, time.time)
    assert reopened.redeem(ticket.ticket_id, ticket.expires_at, ticket.principal) is None
    reopened.close()
