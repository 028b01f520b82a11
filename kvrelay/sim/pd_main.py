"""`python -m kvrelay.sim.pd_main --seeds 5000`: the pd simulation on its own.

Until kvrelay/sim/__main__.py wires ``add_pd_parser`` (then: `python -m kvrelay.sim pd`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvrelay.sim.pd import add_pd_parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.sim")
    sub = parser.add_subparsers(dest="command", required=True)
    add_pd_parser(sub)
    args = parser.parse_args(["pd", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
