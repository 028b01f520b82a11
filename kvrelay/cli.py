"""The ``kvrelay`` command line.

Each command lives in its own module, which exposes ``register(subparsers)``;
the module adds its parser and sets ``func`` (taking the parsed args, returning
an exit code). Modules are imported when the command line is parsed, so keep
their top level light (import torch and friends inside the command function).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Top-level commands, and the `kvrelay bench` subcommands.
COMMANDS: list[str] = [
    "kvrelay.model.cli",
    "kvrelay.server.cli",
    "kvrelay.server.proxy",
    "kvrelay.server.demo",
]
BENCH_COMMANDS: list[str] = [
    "kvrelay.bench.core",
    "kvrelay.bench.transfer",
    "kvrelay.bench.offline",
    "kvrelay.bench.serve",
    "kvrelay.bench.relay",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _register(name, sub)
    bench = sub.add_parser("bench", help="benchmarks that print a ratio against a reference")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_COMMANDS:
        _register(name, bench_sub)
    return parser


def _register(module_name: str, subparsers: argparse._SubParsersAction) -> None:
    importlib.import_module(module_name).register(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
