"""Role mapping: claim paths, the values that grant each role, default deny, and the separation
of admin and auditor."""

from __future__ import annotations

import pytest

from appliance.auth.errors import AuthorizationError
from appliance.auth.roles import ClaimPath, Role, RoleMapping

KEYCLOAK = {
    "realm_access": {"roles": ["inferno-user", "offline_access"]},
    "resource_access": {"inferno.example.com": {"roles": ["operator"]}},
    "scope": "openid inference",
    "groups": "not-a-list-of-values but words",
    "roles": [7, "ops", {"nested": "x"}],
}


@pytest.mark.parametrize(
    ("path", "values"),
    [
        ("realm_access.roles", {"inferno-user", "offline_access"}),
        ('resource_access."inferno.example.com".roles', {"operator"}),
        ("scope", {"openid", "inference"}),
        ("roles", {"ops"}),  # only the strings of a list
        ("realm_access", set()),  # an object grants nothing
        ("absent.path", set()),
        ("scope.deeper", set()),
    ],
)
def test_claim_path_reads_strings_lists_and_space_separated_scopes(
    path: str, values: set[str]
) -> None:
    assert ClaimPath.parse(path).values(KEYCLOAK) == values


@pytest.mark.parametrize("text", ["", "a..b", "a.", '"unterminated', 'a"b"'])
def test_malformed_claim_path_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="claim path"):
        ClaimPath.parse(text)


def test_quoted_segment_round_trips() -> None:
    path = ClaimPath.parse('resource_access."a.b".roles')
    assert path.segments == ("resource_access", "a.b", "roles")
    assert str(path) == 'resource_access."a.b".roles'


def _mapping(**values: list[str]) -> RoleMapping:
    return RoleMapping(
        (ClaimPath.parse("realm_access.roles"), ClaimPath.parse("scope")),
        {Role(name): frozenset(v) for name, v in values.items()},
    )


def test_roles_are_granted_only_by_mapped_values() -> None:
    mapping = _mapping(user=["inferno-user"], service=["inference"], admin=["inferno-admin"])
    assert mapping.roles(KEYCLOAK) == {Role.USER, Role.SERVICE}
    assert mapping.roles({}) == frozenset()
    assert _mapping(admin=["Inferno-User"]).roles(KEYCLOAK) == frozenset()  # exact case


def test_claims_granting_admin_and_auditor_are_denied() -> None:
    mapping = _mapping(admin=["inferno-user"], auditor=["inference"])
    with pytest.raises(AuthorizationError, match="separation of duties"):
        mapping.roles(KEYCLOAK)


def test_one_value_for_admin_and_auditor_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="both admin and auditor"):
        _mapping(admin=["staff"], auditor=["staff"])
