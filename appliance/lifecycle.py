"""The commands the bundle's install.py runs with a release before it switches `current` to it
(docs/INSTALL.md, "Upgrade and rollback"):

    inferno config check [--config FILE]
        read the settings as `inferno serve` does and start nothing; a file this release cannot
        read exits 2 with the setting named, which stops the upgrade or rollback
    inferno admin record-install --config FILE --action install|upgrade|rollback --version V
        --bundle-digest HEX --who NAME [--previous V]
        append `admin.<action>` to the audit log of FILE (only its `[audit]` is read, so a
        production template not yet filled in will do): who ran install.py (its OS user, or
        the one sudo names), the version, the previous one, the SHA-256 of the bundle's
        MANIFEST.json

Both are light: neither imports torch.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.settings_file import add_config_arg, settings_file

INSTALL_ACTIONS = ("install", "upgrade", "rollback")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")


if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


def add_commands(
    commands: _Commands, command: Callable[[_Commands, str, str], argparse.ArgumentParser]
) -> None:
    """Register `config check` and `admin record-install`; `command(commands, name, summary)`
    makes each subcommand as the rest of the `inferno` command line does."""
    config = command(commands, "config", "check a settings file")
    check = command(
        config.add_subparsers(required=True, metavar="ACTION"),
        "check",
        "read a settings file as serve does and start nothing",
    )
    add_config_arg(check, demo_default=False)
    check.set_defaults(run=run_config_check)

    admin = command(commands, "admin", "what install.py records in the audit log")
    record = command(
        admin.add_subparsers(required=True, metavar="ACTION"),
        "record-install",
        "append admin.install, upgrade or rollback to the audit log",
    )
    record.add_argument("--config", type=Path, metavar="FILE", required=True)
    record.add_argument("--action", choices=INSTALL_ACTIONS, required=True)
    record.add_argument(
        "--version", dest="release_version", type=_version, required=True, metavar="V"
    )
    record.add_argument("--previous", type=_version, metavar="V", help="the version before")
    record.add_argument("--bundle-digest", type=_sha256, required=True, metavar="HEX")
    record.add_argument("--who", type=_who, required=True, help="who ran install.py")
    record.set_defaults(run=run_record_install)


def _version(value: str) -> str:
    if not _VERSION.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a plain version")
    return value


def _sha256(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise argparse.ArgumentTypeError("not 64 lowercase hex digits")
    return value


def _who(value: str) -> str:
    if not 0 < len(value) <= 256 or not value.isprintable():
        raise argparse.ArgumentTypeError("not a printable name of at most 256 characters")
    return value


def run_config_check(args: argparse.Namespace) -> int:
    from appliance.config import load_settings

    path = settings_file(args.config, demo_default=False)
    settings = load_settings(path)
    print(f"{path}: the settings are valid (profile {settings.appliance.profile})")
    return 0


def run_record_install(args: argparse.Namespace) -> int:
    from appliance.boot.audit_log import open_audit_log
    from appliance.config import AuditSettings, load_section
    from audit.event import Actor, Outcome, admin_action

    who = args.who
    target = {
        "version": args.release_version,
        "previous_version": args.previous,
        "bundle_digest": f"sha256:{args.bundle_digest}",
        "who": who,
    }
    event = admin_action(
        time=datetime.now(UTC),
        actor=Actor(issuer="local", subject=who, client="install.py"),
        source_address=None,
        request_id=None,
        operation=args.action,
        outcome=Outcome.SUCCESS,
        target=target,
    )
    with open_audit_log(load_section(args.config, AuditSettings)) as log:
        log.append(event)
    print(f"recorded admin.{args.action} of {args.release_version}")
    return 0
