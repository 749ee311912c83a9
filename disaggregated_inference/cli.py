"""``disagg``, the command line: the cluster's own commands (``up``, ``serve``, ``generate``, ``demo``,
``doctor``, ``top``, ...) from ``ops/cli.py``, and ``disagg bench``, which starts and measures clusters
(``bench/``, a layer above ``ops/``), added here at the top."""
from __future__ import annotations

import sys

from .ops import cli as ops_cli


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_bench(args) -> int:
    from .bench.options import from_args
    from .bench.run import main as bench

    return bench(from_args(args), _say, print)


def add_bench(sub, with_config) -> None:
    from .bench.options import add_arguments

    p = with_config(sub.add_parser("bench", help="measure a cluster against the design documents' success metrics "
                                                 "(seed 004), beside peers; writes bench.json, bench.md, charts"))
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


COMMANDS = (add_bench,)


def build_parser():
    return ops_cli.build_parser(COMMANDS)


def main(argv=None) -> int:
    return ops_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    raise SystemExit(main())
