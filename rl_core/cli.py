"""Command-line front door shared by the jobs: `--config NAME_OR_PATH key=value ...`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from rl_core.config import ConfigError, load_config


def parse_job_config(argv: list[str] | None, description: str, default_config: str, schema: type,
                     validate: Callable[[Any], None] | None = None):
    """Parse the command line and return a validated config, or exit 2 with one clear line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config,
                        help="recipe path, or a bare name under configs/ (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides, e.g. trainer.total_episodes=256")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides, schema=schema, validate=validate)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
