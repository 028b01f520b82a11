"""``python -m kvrelay.sim engine|pd --seeds N`` (or ``--seed S --trace`` to replay one)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol


class _Result(Protocol):
    seed: int
    trace: list[str]
    violation: str | None


def run_seeds(
    name: str, run_seed: Callable[[int], _Result], seeds: Sequence[int], show_trace: bool
) -> int:
    """Run seeds, print each violation with its replay command; exit code 1 on any."""
    started = time.perf_counter()
    violations = 0
    for seed in seeds:
        result = run_seed(seed)
        if show_trace:
            print("\n".join(result.trace))
        if result.violation is not None:
            violations += 1
            print(f"seed {seed}: {result.violation}")
            print(f"  replay: python -m kvrelay.sim {name} --seed {seed} --trace")
    elapsed = time.perf_counter() - started
    print(f"{len(seeds)} seeds, {violations} violations ({elapsed:.1f} s)")
    return 1 if violations else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.sim")
    sub = parser.add_subparsers(dest="sim", required=True)
    for name, help_text in (("engine", "one engine: scheduler, lifecycle, async steps"),):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--seeds", type=int, default=2000, help="run seeds 0..N-1")
        p.add_argument("--start", type=int, default=0, help="first seed")
        p.add_argument("--seed", type=int, default=None, help="run (replay) this one seed")
        p.add_argument("--trace", action="store_true", help="print each seed's event trace")
    from kvrelay.sim.pd import add_pd_parser

    add_pd_parser(sub)
    args = parser.parse_args(argv)
    if args.sim == "pd":
        return int(args.func(args))
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    from kvrelay.sim.engine_sim import run_seed

    return run_seeds(args.sim, run_seed, list(seeds), args.trace)


if __name__ == "__main__":
    sys.exit(main())
