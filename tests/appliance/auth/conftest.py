"""A real OpenID provider per test module (tests/appliance/auth/idp.py), serving the test realm
(tests/appliance/auth/realm.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.appliance.auth.idp import IdpCa, OidcProvider
from tests.appliance.auth.realm import start_idp


@pytest.fixture(scope="module")
def idp_ca(tmp_path_factory: pytest.TempPathFactory) -> IdpCa:
    return IdpCa.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def idp(idp_ca: IdpCa, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    provider = start_idp(tmp_path_factory.mktemp("idp"), idp_ca)
    try:
        yield provider
    finally:
        provider.stop()
