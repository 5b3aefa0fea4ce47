"""`python -m installer COMMAND`: the installer's commands. Each command module registers its
subcommands with an `add_commands(commands)` function and sets `run` on its parser; adding a
command is one line in `_COMMAND_MODULES`."""

from __future__ import annotations

import argparse
import sys

from installer import seal

_COMMAND_MODULES = (seal,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m installer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for module in _COMMAND_MODULES:
        module.add_commands(commands)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
