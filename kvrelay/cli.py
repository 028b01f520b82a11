"""The ``kvrelay`` command line.

Each command lives in its own module, which exposes ``register(subparsers)``;
the module adds its parser and sets ``func`` (taking the parsed args, returning
an exit code). Modules are imported when the command line is parsed, so keep
their top level light (import torch and friends inside the command function).

Exit codes, the same in every command: 0 done; 1 the command ran and failed (a
port taken, a server that died); 2 the command line or what it names is wrong (a
flag value, a model path that does not exist or cannot be read, a missing optional
package), reported in one line as ``kvrelay COMMAND: what is wrong``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvrelay.errors import EXIT_USAGE, UsageError

# Top-level commands, and the `kvrelay bench` subcommands.
COMMANDS: list[str] = [
    "kvrelay.model.cli",
    "kvrelay.server.cli",
    "kvrelay.proxy.app",
    "kvrelay.demo",
]
BENCH_COMMANDS: list[str] = [
    "kvrelay.bench.core",
    "kvrelay.bench.transfer",
    "kvrelay.bench.offline",
    "kvrelay.bench.decode",
    "kvrelay.bench.quant",
    "kvrelay.bench.serve",
    "kvrelay.bench.relay",
    "kvrelay.bench.grammar",
    "kvrelay.bench.sampling",
    "kvrelay.bench.prefix",
    "kvrelay.bench.routing",
    "kvrelay.bench.conditional",
    "kvrelay.bench.chaos",
    "kvrelay.bench.soak",
    "kvrelay.bench.front",
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
        help="how idle OpenMP threads wait: spin (active), sleep after a ~0.1 ms spin "
        "(passive, the default) or chosen from the CPUs free for --threads (auto: spin, or "
        "sleep at once) (env KVRELAY_OMP_WAIT_POLICY)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _register(name, sub)
    bench = sub.add_parser("bench", help="benchmarks that print a ratio against a reference")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_COMMANDS:
        _register(name, bench_sub)
    _show_defaults(parser)
    return parser


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text.lower()
            or not action.option_strings
            or "key" in action.dest or "secret" in action.dest  # never print a secret
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return text
        return text + " (default: %(default)s)"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
        elif action.help is None and action.option_strings and action.default not in (
            None, False, argparse.SUPPRESS
        ):
            action.help = "default: %(default)s"


def _register(module_name: str, subparsers: argparse._SubParsersAction) -> None:
    importlib.import_module(module_name).register(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _apply_process_settings(args)  # before anything imports torch (OpenMP reads it once)
    words = [args.command, getattr(args, "bench_command", None)]
    prog = " ".join(["kvrelay", *(w for w in words if w)])
    from kvrelay.model.config import RefusedChoice, UnsupportedModel

    try:
        return int(args.func(args) or 0)
    except (UsageError, FileNotFoundError, UnsupportedModel, RefusedChoice) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.startswith("kvrelay"):
            raise
        print(f"{prog}: needs the Python package {exc.name!r}, which is not installed "
              f"(pip install {exc.name})", file=sys.stderr)
        return EXIT_USAGE


def _apply_process_settings(args: argparse.Namespace) -> None:
    from kvrelay import env
    from kvrelay.model.kernels import choice as kernel_choice

    if args.kernels:
        env.setenv("KVRELAY_KERNELS", args.kernels)
    if args.omp_wait_policy:
        kernel_choice.apply_wait_policy(args.omp_wait_policy, getattr(args, "threads", None))


if __name__ == "__main__":
    sys.exit(main())
