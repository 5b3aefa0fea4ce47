"""Audit test fixtures: a database URL fixture that runs a test once on SQLite and once on
PostgreSQL (the session's real server, tests/conftest.py), and settings for a log on it."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from audit.log import AuditLogSettings
from audit.policy import CheckpointPolicy


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for one test, on each backend; every test also gets its own log origin."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.db'}"
    return request.getfixturevalue("postgres_server")


@pytest.fixture
def origin() -> str:
    return f"inferno.test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def log_settings(db_url: str, origin: str, tmp_path: Path) -> Callable[..., AuditLogSettings]:
    """Settings for an AuditLog on this test's backend; pass overrides as keywords."""

    def make(**policy: float) -> AuditLogSettings:
        return AuditLogSettings(
            origin=origin,
            database_url=db_url,
            key_dir=tmp_path / "keys",
            policy=CheckpointPolicy(**policy),
        )

    return make
