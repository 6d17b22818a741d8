"""The `--set KEY=VALUE` option every command that reads a configuration or run file takes (argparse
only, so that building the CLI's parser imports nothing heavy); `runtime.config.load_config` applies the
collected `overrides`."""

from __future__ import annotations

import argparse


def add_set_argument(parser: argparse.ArgumentParser, text: str) -> None:
    """`--set KEY=VALUE`, repeatable, collected in order into `args.overrides`."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=text
    )
