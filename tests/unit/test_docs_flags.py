"""The flag tables in docs/server.md and docs/operations.md list exactly the flags of
`kvrelay serve`, `kvrelay proxy` and the global ones of `kvrelay` (STYLE 17): a flag
added to a parser and not documented, or documented and gone, fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvrelay import cli as top
from kvrelay.proxy import app as proxy
from kvrelay.server import cli

DOCS = Path(__file__).resolve().parents[2] / "docs"


def parser_flags(module: object) -> set[str]:
    top = argparse.ArgumentParser()
    module.register(top.add_subparsers())  # type: ignore[attr-defined]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    (parser,) = sub.choices.values()
    return {o for a in parser._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def documented(path: Path) -> set[str]:
    """Flags named in the first cell of a table row."""
    out: set[str] = set()
    for line in path.read_text().splitlines():
        if line.startswith("| `--"):
            out |= set(re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1]))
    return out


def test_serve_and_proxy_flags_are_the_documented_ones() -> None:
    serve, prox = parser_flags(cli), parser_flags(proxy)
    glob = {o for a in top.build_parser()._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}
    assert {"--lease-timeout", "--threads", "--dtype"} <= serve and "--decode" in prox
    docs = documented(DOCS / "server.md") | documented(DOCS / "operations.md")
    assert docs - (serve | prox | glob) == set(), "documented flags that no parser has"
    assert (serve | prox | glob) - docs == set(), "flags missing from the docs' tables"
