"""Collect a CPU report or quote through configfs-tsm (the edge: file-system IO only).

configfs-tsm (Linux 6.7+, Documentation/ABI/testing/configfs-tsm) gives one interface to the
SEV-SNP (`sev_guest`) and TDX (`tdx_guest`) report providers: `mkdir` an entry under
`/sys/kernel/config/tsm/report`, write the 64-byte `inblob` (report_data), read `outblob` (the
report or quote), `auxblob` (SNP: the certificate table, if the host supplies one) and
`provider`, then `rmdir`. Every write to the entry increments `generation`; reading it before
and after shows whether another writer raced us, in which case `outblob` may answer someone
else's `inblob` and the collection is retried (then refused).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import threading
from pathlib import Path

from attestation.cpu.evidence import PROVIDER_KINDS, CpuEvidence
from attestation.errors import CollectionError

DEFAULT_TSM_ROOT = Path("/sys/kernel/config/tsm/report")
REPORT_DATA_SIZE = 64
NUM_ATTEMPTS = 3


def collect_cpu_evidence(
    report_data: bytes,
    *,
    tsm_root: Path = DEFAULT_TSM_ROOT,
    timeout_s: float = 30.0,
) -> CpuEvidence:
    """A fresh report binding `report_data` (64 bytes) from the configfs-tsm report directory
    `tsm_root`. Raises CollectionError if configfs-tsm is absent, the entry cannot be created
    or read, the provider is unknown, a concurrent writer keeps racing, or the provider does
    not answer within `timeout_s` (a guest request the host never completes)."""
    if len(report_data) != REPORT_DATA_SIZE:
        raise ValueError(f"report_data must be {REPORT_DATA_SIZE} bytes, got {len(report_data)}")
    if not tsm_root.is_dir():
        raise CollectionError(
            f"configfs-tsm is not available: {tsm_root} does not exist. It needs Linux 6.7+ "
            "with CONFIG_TSM_REPORTS, configfs mounted at /sys/kernel/config, and the sev-guest "
            "or tdx-guest driver loaded inside a confidential VM"
        )
    for _ in range(NUM_ATTEMPTS):
        evidence = _collect_once(tsm_root, report_data, timeout_s)
        if evidence is not None:
            return evidence
    raise CollectionError(
        f"another writer kept changing the configfs-tsm entry ({NUM_ATTEMPTS} attempts); "
        "refusing a report that may answer someone else's report_data"
    )


def _collect_once(tsm_root: Path, report_data: bytes, timeout_s: float) -> CpuEvidence | None:
    entry = tsm_root / f"inferno-{secrets.token_hex(8)}"
    try:
        entry.mkdir()
    except OSError as exc:
        raise CollectionError(f"cannot create configfs-tsm entry {entry}: {exc}") from exc
    try:
        before = _generation(entry)
        _write_attribute(entry / "inblob", report_data)
        after_write = _generation(entry)
        outblob = _read_with_timeout(entry / "outblob", timeout_s)
        auxblob = _read_optional(entry / "auxblob")
        provider = _read_attribute(entry / "provider").decode("ascii", "replace").strip()
        if after_write != before + 1 or _generation(entry) != after_write:
            return None
    finally:
        # configfs removes the entry's attributes with it; a failure leaves only an empty entry.
        with contextlib.suppress(OSError):
            entry.rmdir()
    kind = PROVIDER_KINDS.get(provider)
    if kind is None:
        raise CollectionError(f"unknown configfs-tsm provider {provider!r}")
    if not outblob:
        raise CollectionError(f"the {provider} provider returned an empty report")
    return CpuEvidence(kind=kind, report=outblob, auxblob=auxblob or None, provider=provider)


def _generation(entry: Path) -> int:
    raw = _read_attribute(entry / "generation").strip()
    try:
        return int(raw)
    except ValueError:
        raise CollectionError(f"configfs-tsm generation is not a number: {raw!r}") from None


def _read_optional(path: Path) -> bytes:
    try:
        return _read_attribute(path)
    except CollectionError as exc:
        if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in (
            errno.ENOENT,
            errno.ENXIO,
            errno.EOPNOTSUPP,
        ):
            return b""
        raise


def _read_with_timeout(path: Path, timeout_s: float) -> bytes:
    # A configfs read blocks in the kernel until the firmware answers; a thread lets the caller
    # give up (the thread stays blocked, but the boot gate can fail closed instead of hanging).
    result: list[bytes | BaseException] = []

    def read() -> None:
        try:
            result.append(_read_attribute(path))
        except BaseException as exc:  # handed to the caller below
            result.append(exc)

    thread = threading.Thread(target=read, name="configfs-tsm-read", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise CollectionError(f"configfs-tsm did not answer within {timeout_s} s ({path.name})")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _read_attribute(path: Path) -> bytes:
    """Read one configfs attribute. This and `_write_attribute` are the only IO; tests replace
    them to emulate a provider (a plain directory cannot compute an outblob)."""
    try:
        with open(path, "rb", buffering=0) as handle:
            return handle.read()
    except OSError as exc:
        raise CollectionError(f"cannot read {path}: {os.strerror(exc.errno or 0)}") from exc


def _write_attribute(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb", buffering=0) as handle:
            handle.write(data)
    except OSError as exc:
        raise CollectionError(f"cannot write {path}: {os.strerror(exc.errno or 0)}") from exc
