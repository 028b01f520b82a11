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
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__.splitlines()[0])
    # Process-wide settings that must be in place before torch is imported (libgomp
    # reads its wait policy once), hence before the command runs: see docs/model.md.
    parser.add_argument(
        "--kernels", choices=["auto", "native", "torch"], default=None,
        help="layer kernels: native C++ (default where built) or pure torch "
        "(env KVRELAY_KERNELS)",
    )
    parser.add_argument(
        "--omp-wait-policy", choices=["active", "passive", "auto"], default=None,
        help="how idle OpenMP threads wait: spin (active), sleep (passive, the default) or "
        "chosen from the CPUs free for --threads (auto) (env KVRELAY_OMP_WAIT_POLICY)",
    )
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
    _apply_process_settings(args)
    return int(args.func(args) or 0)


def _apply_process_settings(args: argparse.Namespace) -> None:
    import os

    from kvrelay.model import kernel_choice

    if args.kernels:
        os.environ["KVRELAY_KERNELS"] = args.kernels
    if args.omp_wait_policy:
        kernel_choice.apply_wait_policy(args.omp_wait_policy, getattr(args, "threads", None))


if __name__ == "__main__":
    sys.exit(main())
