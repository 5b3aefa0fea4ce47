"""Prefix-cache isolation domains through the real server: a caller reuses the cached prefixes
of its own domain and never another's, whatever `cache_salt` it sends (counted by
`usage.prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.api.cache_domains import domain_salt, request_salt
from appliance.auth.principal import Principal
from appliance.auth.roles import Role
from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server

# About 80 tokens: several full KV blocks of 16 for the prefix cache to hold.
TEXT = "The committee reviewed the quarterly figures and agreed on the following points. " * 5


def _prompt() -> str:
    """A prompt no earlier test sent: the engine, and its prefix cache, outlive each server."""
    return f"{uuid.uuid4().hex} {TEXT}"


def _cached_tokens(
    server: RunningServer, subject: str, prompt: str, *, role: Role = Role.USER, **extra: str
) -> int:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, **extra}
    with server.http(role, subject) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def role_server(
    api_engine: Engine, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(
        tmp_path_factory.mktemp("tls"), smollm2_dir, engine={"prefix_cache_isolation": "role"}
    )
    with running_server(settings, api_engine) as running:
        yield running


def test_by_default_a_principal_reuses_its_own_prefixes_and_never_anothers(
    server: RunningServer,
) -> None:
    prompt = _prompt()
    assert _cached_tokens(server, "alice", prompt) == 0
    assert _cached_tokens(server, "alice", prompt) > 0
    assert _cached_tokens(server, "bob", prompt) == 0
    assert _cached_tokens(server, "bob", prompt) > 0


def test_a_client_salt_narrows_a_domain_and_never_joins_another(server: RunningServer) -> None:
    prompt = _prompt()
    assert _cached_tokens(server, "alice", prompt, cache_salt="team-a") == 0
    assert _cached_tokens(server, "alice", prompt) == 0, "the salt made its own domain"
    assert _cached_tokens(server, "bob", prompt, cache_salt="team-a") == 0
    assert _cached_tokens(server, "alice", prompt, cache_salt="team-a") > 0


def test_under_role_isolation_principals_of_one_role_share_and_other_roles_do_not(
    role_server: RunningServer,
) -> None:
    prompt = _prompt()
    assert _cached_tokens(role_server, "alice", prompt) == 0
    assert _cached_tokens(role_server, "bob", prompt) > 0
    assert _cached_tokens(role_server, "svc", prompt, role=Role.SERVICE) == 0


def _principal(issuer: str, subject: str, *roles: Role) -> Principal:
    return Principal(issuer, subject, None, frozenset(roles), expires_at=0.0)


def test_each_policy_puts_principals_in_the_domains_it_names() -> None:
    alice = _principal("https://idp.a", "alice", Role.USER)
    bob = _principal("https://idp.a", "bob", Role.USER)
    mallory = _principal("https://idp.b", "alice", Role.USER)
    service = _principal("https://idp.a", "svc", Role.SERVICE)
    same = {
        "principal": [(alice, alice)],
        "role": [(alice, bob), (alice, mallory)],
        "issuer": [(alice, bob), (alice, service)],
        "shared": [(alice, mallory), (alice, service)],
    }
    apart = {
        "principal": [(alice, bob), (alice, mallory)],
        "role": [(alice, service)],
        "issuer": [(alice, mallory)],
        "shared": [],
    }
    for isolation in same:
        for a, b in same[isolation]:
            assert domain_salt(isolation, a) == domain_salt(isolation, b), (isolation, a, b)
        for a, b in apart[isolation]:
            assert domain_salt(isolation, a) != domain_salt(isolation, b), (isolation, a, b)
    # A subject that spells another issuer's name plus a subject cannot meet it.
    tricky = _principal("https://idp.a", "", Role.USER)
    assert domain_salt("principal", tricky) != domain_salt(
        "principal", _principal("https://idp.", "a", Role.USER)
    )


def test_a_client_salt_cannot_name_another_domains_salt() -> None:
    alice = domain_salt("principal", _principal("https://idp.a", "alice", Role.USER))
    bob = domain_salt("principal", _principal("https://idp.a", "bob", Role.USER))
    assert request_salt(bob, alice) not in (alice, request_salt(alice, None))
    assert request_salt(bob, None) == bob
