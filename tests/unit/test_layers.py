"""The layers of docs/ARCHITECTURE.md: no module imports one of a higher layer, nor one
of a sibling package of its own layer (the engine server, the proxy and the vLLM
adapter never import each other), and no import cycle anywhere. Imports inside
functions and under ``if TYPE_CHECKING:`` count: a cycle of types is still a cycle a
reader must walk. The layer table and the import graph are scripts/house.py's, the
script that measures the house for a reader: the rule and the measure cannot drift."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _house() -> ModuleType:
    spec = importlib.util.spec_from_file_location("house", REPO / "scripts" / "house.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["house"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


house = _house()


def graph_of(root: Path) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = house.import_graph(house.load(root))
    return edges


def test_every_module_has_a_layer() -> None:
    mods = house.load(REPO)
    assert not [n for n in mods if n != "kvrelay" and house.layer(n) is None]


def test_no_module_imports_up_or_across_the_layers() -> None:
    offenders = house.against_layers(graph_of(REPO))
    assert not offenders, "\n".join(f"{a} -> {b}" for a, b in offenders)


def test_no_import_cycles() -> None:
    found = [c for c in house.tarjan(graph_of(REPO)) if len(c) > 1]
    assert not found, found


def test_the_rules_see_what_they_forbid(tmp_path: Path) -> None:
    """Absolute, relative, function-level and TYPE_CHECKING imports that go up, across
    siblings, or round in a circle are all caught."""
    for rel, text in {
        "__init__.py": "", "core/__init__.py": "", "server/__init__.py": "",
        "proxy/__init__.py": "",
        "core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from kvrelay.core.b import B\n",
        "core/b.py": "def f():\n    from . import a\n",
        "core/up.py": "def f():\n    import kvrelay.server.api\n",
        "server/api.py": "from ..proxy.app import X\n",
        "proxy/app.py": "X = 1\n",
    }.items():
        path = tmp_path / "kvrelay" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    edges = graph_of(tmp_path)
    assert [c for c in house.tarjan(edges) if len(c) > 1] == [
        ["kvrelay.core.a", "kvrelay.core.b"]]
    assert house.against_layers(edges) == [("kvrelay.core.up", "kvrelay.server.api"),
                                           ("kvrelay.server.api", "kvrelay.proxy.app")]


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
