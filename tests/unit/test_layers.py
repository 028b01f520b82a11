"""The layers of docs/ARCHITECTURE.md: no module imports one of a higher layer, nor one
of a sibling package of its own layer (the engine server, the proxy and the vLLM
adapter never import each other), and no import cycle anywhere. Imports inside
functions and under ``if TYPE_CHECKING:`` count: a cycle of types is still a cycle a
reader must walk. The package root ``kvrelay`` (its lazy ``LLM``/``SamplingParams``)
is exempt as an importer; anyone may read its ``__version__``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).parent

# Lowest first. A module belongs to the layer of its longest matching prefix. Layers
# marked as siblings hold packages that must not import each other.
LAYERS: list[tuple[str, tuple[str, ...], bool]] = [
    ("base", ("kvrelay.errors", "kvrelay.config", "kvrelay.sampling_params",
              "kvrelay.env"), False),
    ("core", ("kvrelay.core",), False),
    ("relay", ("kvrelay.relay",), False),
    ("model contracts", ("kvrelay.model.config", "kvrelay.model.interface"), False),
    ("model text and sampling", ("kvrelay.model.text", "kvrelay.model.sampling"), True),
    ("model formats", ("kvrelay.model.formats",), False),
    ("model kernels", ("kvrelay.model.kernels",), False),
    ("model", ("kvrelay.model",), False),
    ("wire", ("kvrelay.wire",), False),
    ("adapters", ("kvrelay.server", "kvrelay.proxy", "kvrelay.vllm"), True),
    ("testing", ("kvrelay.testing",), False),
    ("demo", ("kvrelay.demo",), False),
    ("tools", ("kvrelay.sim", "kvrelay.bench"), True),
    ("cli", ("kvrelay.cli",), False),
    ("main", ("kvrelay.__main__",), False),
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(src: str, package: str) -> list[str]:
    """Every name ``src`` (a module of ``package``) imports from, relative imports
    resolved: ``import a.b`` gives ``a.b``, ``from a import b`` gives ``a.b`` (a module,
    or a name of ``a``: ``graph`` resolves it to the nearest module)."""
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
            out += [f"{base}.{a.name}" for a in node.names]
    return out


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, each name resolved to the nearest
    module above it (``from pkg import name`` is an edge to ``pkg``)."""
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges[name] = set()
        for imp in imports_of(path.read_text(), package):
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                edges[name].add(imp)
    return edges


def layer_of(name: str) -> tuple[int, str] | None:
    """(layer index, the package prefix that placed it) by the longest prefix."""
    found = [(len(p), i, p) for i, (_, prefixes, _) in enumerate(LAYERS) for p in prefixes
             if name == p or name.startswith(p + ".")]
    return (max(found)[1], max(found)[2]) if found else None


def violations(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for a, targets in sorted(edges.items()):
        if a == "kvrelay":
            continue
        la = layer_of(a)
        if la is None:
            out.append(f"{a}: in no layer (add it to LAYERS and docs/ARCHITECTURE.md)")
            continue
        for b in sorted(targets - {"kvrelay"}):
            lb = layer_of(b)
            if lb is None:
                continue  # reported as the importer of its own edges
            if lb[0] > la[0]:
                out.append(f"{a} -> {b}: up from {LAYERS[la[0]][0]} to {LAYERS[lb[0]][0]}")
            elif lb[0] == la[0] and LAYERS[la[0]][2] and la[1] != lb[1]:
                out.append(f"{a} -> {b}: between siblings of {LAYERS[la[0]][0]}")
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_imports_up_or_across_the_layers() -> None:
    offenders = violations(graph(modules()))
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles() -> None:
    found = cycles(graph(modules()))
    assert not found, found


def test_the_rules_see_what_they_forbid(tmp_path: Path) -> None:
    """The checks catch absolute, relative, function-level and TYPE_CHECKING imports
    that go up, across siblings, or round in a circle."""
    src = ("def f():\n    from kvrelay.model.sampling.grammar import GrammarMasks\n"
           "from ..relay import lease\nimport kvrelay.server.api\n")
    names = imports_of(src, "kvrelay.core")
    assert {"kvrelay.model.sampling.grammar.GrammarMasks", "kvrelay.relay.lease",
            "kvrelay.server.api"} <= set(names)
    pkg = tmp_path / "kvrelay"
    for rel, text in {
        "__init__.py": "", "core/__init__.py": "", "server/__init__.py": "",
        "proxy/__init__.py": "",
        "core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from kvrelay.core.b import B\n",
        "core/b.py": "def f():\n    from kvrelay.core import a\n",
        "core/up.py": "def f():\n    import kvrelay.server.api\n",
        "server/api.py": "from kvrelay.proxy.app import X\n",
        "proxy/app.py": "X = 1\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    edges = graph(modules(pkg))
    assert cycles(edges) == [["kvrelay.core.a", "kvrelay.core.b"]]
    found = violations(edges)
    assert any(v.startswith("kvrelay.core.up -> kvrelay.server.api: up") for v in found)
    assert any(v.startswith("kvrelay.server.api -> kvrelay.proxy.app: between") for v in found)


def test_the_proxy_loads_no_model_code_and_no_torch() -> None:
    """The proxy is its own process in front of many engines: starting it must not load
    the model package (nor torch). ``import kvrelay`` itself reads the OpenMP wait
    policy from kvrelay.model.kernels.choice (pure Python, no torch), before anything
    can import torch: that one module, and its two packages, are allowed."""
    code = ("import sys, kvrelay.proxy.app; "
            "print(' '.join(m for m in sys.modules if m == 'torch' "
            "or m.startswith('kvrelay.model')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.split()
    assert set(out) <= {"kvrelay.model", "kvrelay.model.kernels",
                        "kvrelay.model.kernels.choice"}, out
