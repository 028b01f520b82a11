"""The core's layering rule (docs/DESIGN.md, "Layers"): nothing under kvrelay/core, nor
kvrelay/sampling_params.py and kvrelay/config.py which the core imports, imports the
model, the relay or the server; imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).parent
FORBIDDEN = ("kvrelay.model", "kvrelay.relay", "kvrelay.server")


def core_files() -> list[Path]:
    return [*sorted((ROOT / "core").rglob("*.py")), ROOT / "sampling_params.py",
            ROOT / "config.py"]


def imported(path: Path) -> list[str]:
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    return imports_of(path.read_text(), package)


def imports_of(src: str, package: str) -> list[str]:
    """Every module ``src`` (a module of ``package``) imports, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out += [base, *(f"{base}.{a.name}" for a in node.names)]
    return out


def test_the_core_imports_neither_the_model_nor_the_relay_nor_the_server() -> None:
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in core_files() for name in imported(p)
                 if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]
    assert not offenders, offenders


def test_the_rule_sees_what_it_forbids() -> None:
    """The check catches absolute, relative and function-level imports."""
    src = ("def f():\n    from kvrelay.model.sampling.grammar import compile_grammar\n"
           "from ..relay import lease\nimport kvrelay.server.api\n")
    names = imports_of(src, "kvrelay.core")
    assert {"kvrelay.model.sampling.grammar", "kvrelay.relay", "kvrelay.server.api"} <= set(names)
