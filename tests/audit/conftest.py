"""Audit test fixtures: a real PostgreSQL server started for the session, and a database URL
fixture that runs a test once on SQLite and once on PostgreSQL."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from audit.log import AuditLogSettings
from audit.policy import CheckpointPolicy


def _postgres_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    # Debian keeps the server binaries off PATH, under the major version.
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]),
    )
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on a unix socket in a temporary directory; yields its URL.

    PostgreSQL refuses to run as root, so under root (as in CI) the cluster runs as the
    `postgres` user that Debian's package creates.
    """
    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    prefix: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="inferno-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data = base / "data"
    run = {"check": True, "capture_output": True, "timeout": 120}
    try:
        subprocess.run(
            [*prefix, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--no-sync"],
            **run,
        )  # fmt: skip
        options = f"-k {base} -c listen_addresses='' -c fsync=off -c max_connections=200"
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-o", options, "-l", str(base / "log"), "-w",
             "start"],
            **run,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        log = (base / "log").read_text() if (base / "log").exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {exc.stderr.decode()}\n{log}") from exc
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={base}"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], check=False)
        shutil.rmtree(base, ignore_errors=True)


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
