"""`python -m installer COMMAND`: the installer's commands. Each command module registers its
subcommands with an `add_commands(commands)` function and sets `run` on its parser; adding a
command is one line in `_COMMAND_MODULES`."""

from __future__ import annotations

import argparse
import sys

from attestation.errors import AttestationError
from installer import bundle, seal, trust_bundle
from installer.errors import InstallerError

_COMMAND_MODULES = (seal, bundle, trust_bundle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m installer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for module in _COMMAND_MODULES:
        module.add_commands(commands)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (InstallerError, AttestationError) as exc:
        # Expected failures, each saying what to do: one line, no traceback.
        print(f"python -m installer {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
