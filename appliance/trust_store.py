"""The trust store (`tee.trust_dir`): the installed attestation trust bundles
(attestation.trust_bundle), and `inferno trust update`, which installs a new one.

    <trust_dir>/<digest>/   a verified bundle, named by the SHA-256 of its manifest
    <trust_dir>/current     a symbolic link to the bundle in use, switched atomically
    <trust_dir>/.lock       held while an update runs (one at a time)

The bundle in use and the one before it are kept; older ones are removed.

An update, in order; a refusal at any step leaves the store as it was:
 1. Copy the bundle (a directory, or a .tar whose members are checked first) into a private
    directory inside the store, refusing links and special files: what is verified is what is
    installed, whatever happens to the source afterwards.
 2. Verify the copy against `tee.trust_release_key` (signature, layout, every file's size and
    SHA-256).
 3. Refuse a bundle not newer than the installed one: signed but older revocation data is
    exactly what an attacker who wants a revoked certificate accepted would bring.
 4. Record `admin.trust.update` in the audit log; an update the log cannot record does not
    happen.
 5. Rename the copy to `<digest>/`, switch `current` to it, remove bundles older than the one
    it replaces.

At each attestation the appliance looks where `current` points; when that changed, it verifies
the bundle there again before it uses it (appliance.attestation.devices.OfflineVerifier): an
update is in force from the next attestation on, with no restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from appliance.boot.audit_log import open_audit_log
from appliance.config import AuditSettings, TeeSettings, load_section
from appliance.errors import ApplianceError, ConfigError
from attestation.errors import TrustBundleError
from attestation.trust_bundle import (
    MAX_FILE_BYTES,
    TrustBundle,
    TrustBundleId,
    extract_trust_bundle_tar,
    format_created,
    load_release_public_key,
    verify_trust_bundle,
    walk_bundle,
)
from audit.event import Actor, Outcome, admin_action

CURRENT_LINK = "current"
_LOCK_NAME = ".lock"
_DIGEST_NAME = re.compile(r"[0-9a-f]{64}")
UPDATE_OPERATION = "trust.update"


class TrustUpdateError(ApplianceError):
    """A trust bundle was refused, or the store cannot be updated; the store is as it was."""


# Called with the new bundle and the one it replaces (None for the first) before the switch;
# raises if the update must not happen.
UpdateRecorder = Callable[[TrustBundleId, TrustBundleId | None], None]


@dataclass(frozen=True, slots=True)
class TrustStore:
    directory: Path
    release_key_file: Path

    @classmethod
    def from_settings(cls, tee: TeeSettings) -> TrustStore | None:
        """The store `tee.trust_dir` names, or None where the settings name none."""
        if tee.trust_dir is None:
            return None
        assert tee.trust_release_key is not None, "checked by TeeSettings"
        return cls(tee.trust_dir, tee.trust_release_key)

    def current_path(self) -> Path | None:
        """The directory `current` points to (None: no bundle installed). Raises
        TrustBundleError if `current` is anything but a link to a bundle of this store."""
        link = self.directory / CURRENT_LINK
        if not link.is_symlink():
            if link.exists():
                raise TrustBundleError(f"{link} is not a symbolic link to a trust bundle")
            return None
        target = os.readlink(link)
        if not _DIGEST_NAME.fullmatch(target):
            raise TrustBundleError(f"{link} points to {target!r}, not a bundle of the store")
        return self.directory / target

    def load_current(self) -> TrustBundle:
        """The bundle in use, verified again against the release key. Raises TrustBundleError
        when none is installed, or it no longer verifies."""
        path = self.current_path()
        if path is None:
            raise TrustBundleError(
                f"no trust bundle is installed in {self.directory}: install one with "
                "`inferno trust update BUNDLE`"
            )
        return self._verify_installed(path)

    def update(self, source: Path, record: UpdateRecorder) -> TrustBundle:
        """Install the bundle at `source` (the steps of the module docstring). Raises
        TrustUpdateError (the store unchanged) or what `record` raises."""
        try:
            key = load_release_public_key(self.release_key_file)
        except TrustBundleError as exc:
            raise TrustUpdateError(f"tee.trust_release_key: {exc}") from exc
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            with self._locked():
                staging = Path(tempfile.mkdtemp(dir=self.directory, prefix=".incoming-"))
                try:
                    _copy_bundle(source, staging)  # 1
                    bundle = verify_trust_bundle(staging, key)  # 2
                    installed = self._installed()
                    _check_newer(bundle.id, installed)  # 3
                    record(bundle.id, installed)  # 4
                    return self._switch(staging, bundle, installed)  # 5
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        except TrustBundleError as exc:
            raise TrustUpdateError(f"trust bundle refused: {exc}") from exc
        except OSError as exc:
            raise TrustUpdateError(
                f"the trust store {self.directory} cannot be updated: {exc}"
            ) from exc

    def _installed(self) -> TrustBundleId | None:
        try:
            path = self.current_path()
            return None if path is None else self._verify_installed(path).id
        except TrustBundleError as exc:
            # Fail closed: without a trusted date to compare with, no update can be judged
            # newer. The operator removes the broken link deliberately.
            raise TrustUpdateError(
                f"the installed trust bundle does not verify ({exc}); remove "
                f"{self.directory / CURRENT_LINK} to install anew"
            ) from exc

    def _verify_installed(self, path: Path) -> TrustBundle:
        bundle = verify_trust_bundle(path, load_release_public_key(self.release_key_file))
        if bundle.id.digest != path.name:
            raise TrustBundleError(f"{path} holds the bundle {bundle.id.digest}, not its name")
        return bundle

    def _switch(
        self, staging: Path, bundle: TrustBundle, replaced: TrustBundleId | None
    ) -> TrustBundle:
        # Collateral is public; the appliance's service user reads what an administrator
        # installed, and only the installer may change it.
        for directory, _, files in os.walk(staging):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
        final = self.directory / bundle.id.digest
        if final.exists():  # left by an update that failed after its rename: not in use
            shutil.rmtree(final)
        staging.rename(final)
        link = self.directory / f".{CURRENT_LINK}.new"
        link.unlink(missing_ok=True)
        link.symlink_to(bundle.id.digest)
        os.replace(link, self.directory / CURRENT_LINK)
        keep = {bundle.id.digest} | ({replaced.digest} if replaced else set())
        for old in self.directory.iterdir():
            if _DIGEST_NAME.fullmatch(old.name) and old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)
        return TrustBundle(final, bundle.id, bundle.files)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TrustUpdateError("another `inferno trust update` is running") from None
            yield
        finally:
            os.close(fd)


def _check_newer(new: TrustBundleId, installed: TrustBundleId | None) -> None:
    if installed is None:
        return
    if new.digest == installed.digest:
        raise TrustBundleError(f"the bundle {new.digest} is already installed")
    if new.created <= installed.created:
        raise TrustBundleError(
            f"the bundle was created {format_created(new.created)}, not after the installed "
            f"one ({format_created(installed.created)}, {installed.digest}): older collateral "
            "is never installed over newer"
        )


def _copy_bundle(source: Path, dest: Path) -> None:
    """Step 1: `source` (a directory or a .tar) into the empty private directory `dest`."""
    if source.is_symlink():
        raise TrustBundleError(f"{source} is a symbolic link: name the bundle itself")
    if source.is_file() and source.name.endswith(".tar"):
        extract_trust_bundle_tar(source, dest)
    elif source.is_dir():
        for relative in walk_bundle(source):
            target = dest / relative
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(source / relative, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as src, open(target, "xb") as out:
                # Bounded: a file that grew since the walk is refused by its digest later.
                out.write(src.read(MAX_FILE_BYTES + 1))
    else:
        raise TrustBundleError(f"{source} is neither a trust bundle directory nor a .tar")


def update_trust(config_file: Path, source: Path, actor: Actor) -> str:
    """`inferno trust update`: install the bundle at `source` into the store the settings at
    `config_file` name, recording who (`actor`) installed what. Reads only `[tee]` and
    `[audit]`. Returns the line to print. Raises TrustUpdateError or ConfigError."""
    tee = load_section(config_file, TeeSettings)
    store = TrustStore.from_settings(tee)
    if store is None:
        raise ConfigError(f"tee.trust_dir is not set in {config_file}: there is no trust store")
    audit = load_section(config_file, AuditSettings)
    with open_audit_log(audit) as log:

        def record(new: TrustBundleId, replaced: TrustBundleId | None) -> None:
            target = {
                "trust_bundle": new.digest,
                "created": format_created(new.created),
                "replaces": None if replaced is None else replaced.digest,
            }
            log.append(
                admin_action(
                    time=datetime.now(UTC), actor=actor, source_address=None,
                    request_id=None, operation=UPDATE_OPERATION, outcome=Outcome.SUCCESS,
                    target=target,
                )
            )  # fmt: skip

        bundle = store.update(source, record)
    return (
        f"installed trust bundle {bundle.id.digest} (created {format_created(bundle.id.created)}) "
        f"in {store.directory}; it is used from the next attestation on"
    )
