"""Which settings file a command reads: `--config FILE`, else `$INFERNO_CONFIG`, else (for the
commands run beside the demo) the demo's. One place for every `inferno` command."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from appliance.errors import ConfigError

# Names the settings file of every command that reads one, unless --config does.
CONFIG_ENV = "INFERNO_CONFIG"


def add_config_arg(parser: argparse.ArgumentParser, *, demo_default: bool) -> None:
    demo = ", else the demo's settings file" if demo_default else ""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=None,
        help=f"the server's settings file, TOML (default: ${CONFIG_ENV}{demo})",
    )


def settings_file(given: Path | None, *, demo_default: bool) -> Path:
    """The settings file a command reads: --config, else $INFERNO_CONFIG, else (for commands
    run beside the demo) the demo's, if it exists."""
    if given is not None:
        return given
    if named := os.environ.get(CONFIG_ENV):
        return Path(named)
    if demo_default:
        from installer.demo import CONFIG_NAME, demo_dir

        demo_config = demo_dir() / CONFIG_NAME
        if demo_config.is_file():
            return demo_config
        raise ConfigError(
            f"no settings file: give --config FILE or set {CONFIG_ENV}=FILE (the demo's, "
            f"{demo_config}, does not exist: `inferno demo` writes it)"
        )
    raise ConfigError(f"no settings file: give --config FILE or set {CONFIG_ENV}=FILE")
