"""`rlfabric up`'s argument parser, for the unit tests of its flags."""

from __future__ import annotations

import argparse

from rlfabric.local import up_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up_args.add_arguments(parser)
    return parser.parse_args(list(argv))
