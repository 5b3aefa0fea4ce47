"""Owner-only secret files: created 0600 at first start, refused if anyone else could read them."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from audit.errors import KeyFileError


def read_secret_file(path: Path) -> bytes:
    """Read a secret that only its owner (this process's user) may read or write.

    Refuses a symlink, a non-regular file, a file owned by another user, and any group or other
    permission bit, saying how to fix it. Never puts the content in an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise KeyFileError(f"cannot open secret file {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"secret file {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise KeyFileError(
                f"secret file {path} belongs to uid {info.st_uid}, not to this user "
                f"(uid {os.geteuid()}): chown it"
            )
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise KeyFileError(
                f"secret file {path} has mode {mode:04o}, open to group or others: "
                f"chmod 600 {path} (and check who may have read it)"
            )
        return f.read()


def create_secret_file(path: Path, content: bytes) -> None:
    """Write a new secret file with mode 0600, durably; refuses to overwrite an existing one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_or_create_secret(path: Path, generate: Callable[[], bytes]) -> bytes:
    """Read the secret at `path`, creating it from `generate()` at first start."""
    try:
        return read_secret_file(path)
    except FileNotFoundError:
        pass
    try:
        create_secret_file(path, generate())
    except FileExistsError:
        pass  # another process created it first: use theirs
    except OSError as exc:
        raise KeyFileError(f"cannot create secret file {path}: {exc.strerror}") from exc
    return read_secret_file(path)


def write_file_atomically(path: Path, content: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `content` so that a crash leaves either the old or the new file.

    Each writer has its own temporary file: the server and `inferno audit export` may record
    the signer's state at the same moment, and a shared one could be renamed away under the
    other (its write then fails, and a failing signer stops the log).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
