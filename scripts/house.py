"""How kvrelay is housed: package sizes, import cycles, upward imports, call walks.

python scripts/house.py [ROOT] [--depth N]: ROOT (default: the repository holding this
script) holds the package ROOT/kvrelay. Standard library only. A module is one .py
file, named by its dotted path (a package's __init__.py is named like the package).

1. Lines per package: per directory with an __init__.py, all lines of its own .py
   files (not its sub-packages') and their number; kvrelay/'s own files are
   "kvrelay (top)". Then the same per top-level package, sub-packages included.
2. The largest file, and the five largest, by lines.
3. Import cycles: an edge A -> B when module A imports module B anywhere (absolute or
   relative, in functions, under TYPE_CHECKING); `from P import n` goes to P.n when
   that is a module, else to P. Cycles: strongly connected components (Tarjan) of
   more than one module. Imports against the layers: a module is in the layer of
   LAYERS (lowest first) with the longest prefix naming it or a package above it (so
   the old kvrelay.server.proxy_* are kvrelay.server's); kvrelay/__init__.py and the
   modules of no layer (listed) are exempt. Counted: an import from a lower layer to a
   higher one, and one between packages of a layer whose packages are SIBLINGS.
4. Walks: from a start function, its body (nested functions and lambdas included) is
   read for calls in source order; each call resolved to a function of the package
   is walked in turn, depth-first, each function once, down to --depth calls below
   the start. Resolved: `self.m()` to method m of the same class; `f()` to a function
   defined or imported in the module; `mod.f()` for an imported module; `C.m()` for a
   known class C; `C()` to C.__init__ (skipped where C has none); imports are followed
   through re-exports. Nothing else. The file sequence: the file of each visited
   function in visit order, runs of one file merged. rooms = distinct files in it;
   returns = entries into a file it has been in before (A -> B -> A: 1); climbs =
   caller -> callee steps into a higher layer or, within one layer, into a package
   above the caller's (kvrelay.model.kernels -> kvrelay.model).
   Walk a: Proxy.handle (class Proxy, method handle, in a module named *proxy*);
   walk b: build_decode in kvrelay.server.disagg.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The layers of docs/ARCHITECTURE.md, lowest first (tests/unit/test_layers.py holds the
# same table and fails on any import that runs up it); a module is in the layer of its
# longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    ("kvrelay.errors", "kvrelay.config", "kvrelay.sampling_params", "kvrelay.env"),
    ("kvrelay.core",), ("kvrelay.relay",),
    ("kvrelay.model.config", "kvrelay.model.interface"),
    ("kvrelay.model.text", "kvrelay.model.sampling"), ("kvrelay.model.formats",),
    ("kvrelay.model.kernels",), ("kvrelay.model",), ("kvrelay.wire",),
    ("kvrelay.server", "kvrelay.proxy", "kvrelay.vllm"), ("kvrelay.testing",),
    ("kvrelay.demo",), ("kvrelay.sim", "kvrelay.bench"), ("kvrelay.cli",),
    ("kvrelay.__main__",),
]
# Packages of one layer that must not import each other.
SIBLINGS = {"kvrelay.model.text", "kvrelay.model.sampling", "kvrelay.server", "kvrelay.proxy",
            "kvrelay.vllm", "kvrelay.sim", "kvrelay.bench"}
FuncKey = tuple[str, str]  # (module, "func" or "Class.method")


@dataclass
class Module:
    name: str
    rel: str
    is_pkg: bool
    lines: int
    tree: ast.Module
    binds: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # (mod, sym)
    funcs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)
    imports: set[str] = field(default_factory=set)  # imported names, modules or not

    @property
    def package(self) -> str:
        return self.name if self.is_pkg else self.name.rpartition(".")[0]


def load(root: Path) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for path in sorted((root / "kvrelay").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        text = path.read_text(encoding="utf-8")
        mods[name] = Module(name, str(path.relative_to(root)), is_pkg,
                            len(text.splitlines()), ast.parse(text, str(path)))
    for mod in mods.values():
        index(mod, mods)
    return mods


def index(mod: Module, mods: dict[str, Module]) -> None:
    """The module's functions, classes' methods and import bindings (all imports)."""
    for node in mod.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mod.funcs[node.name] = node
        elif isinstance(node, ast.ClassDef):
            mod.classes.add(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    mod.funcs[f"{node.name}.{item.name}"] = item
    for imp in ast.walk(mod.tree):
        if isinstance(imp, ast.Import):
            for alias in imp.names:
                mod.imports.add(alias.name)
                if alias.asname and alias.name in mods:
                    mod.binds[alias.asname] = (alias.name, None)
        elif isinstance(imp, ast.ImportFrom):
            base = from_base(mod, imp)
            for alias in imp.names:
                full = f"{base}.{alias.name}"
                bound = (full, None) if full in mods else (base, alias.name)
                mod.imports.add(bound[0])
                mod.binds[alias.asname or alias.name] = bound


def from_base(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def known(name: str, mods: dict[str, Module]) -> str | None:
    """The deepest module of the package that `name` is or lies in, if any."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Module]) -> dict[str, set[str]]:
    return {m.name: {d for t in m.imports if (d := known(t, mods)) and d != m.name}
            for m in mods.values()}


def tarjan(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    comps: list[list[str]] = []
    for root in sorted(graph):
        if root in order:
            continue
        order[root] = low[root] = len(order)
        stack.append(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in order:
                    order[child] = low[child] = len(order)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], order[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                at = stack.index(node)
                comps.append(sorted(stack[at:]))
                del stack[at:]
    return comps


def placed(name: str) -> tuple[int, str] | None:
    """(layer, the prefix that placed the module there): the longest matching prefix."""
    found = [(len(n), i, n) for i, names in enumerate(LAYERS) for n in names
             if name == n or name.startswith(n + ".")]
    return (max(found)[1], max(found)[2]) if found else None


def layer(name: str) -> int | None:
    where = placed(name)
    return where[0] if where else None


def against_layers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one, or between sibling packages. The
    package root ``kvrelay`` is exempt both ways (its lazy LLM, its __version__)."""
    out = []
    for a, targets in sorted(graph.items()):
        la = placed(a)
        for b in sorted(targets):
            lb = placed(b)
            if a == "kvrelay" or b == "kvrelay" or la is None or lb is None:
                continue
            if lb[0] > la[0] or (lb[0] == la[0] and la[1] != lb[1] and la[1] in SIBLINGS):
                out.append((a, b))
    return out


def is_climb(caller: Module, callee: Module) -> bool:
    lo, hi = layer(caller.name), layer(callee.name)
    if lo is not None and hi is not None and lo != hi:
        return hi > lo
    up, down = callee.package, caller.package
    return lo == hi and down.startswith(up + ".")


def locate(mods: dict[str, Module], mod: str, sym: str, hops: int = 0
           ) -> tuple[str, str] | None:
    """Where function or class `sym` of `mod` is defined, through re-exports."""
    m = mods.get(mod)
    if m is None or hops > 5:
        return None
    if sym in m.funcs or sym in m.classes:
        return (mod, sym)
    bound = m.binds.get(sym)
    return locate(mods, bound[0], bound[1], hops + 1) if bound and bound[1] else None


def resolve_symbol(mods: dict[str, Module], mod: str, sym: str) -> FuncKey | None:
    """A function, or a class's __init__, named `sym` in `mod`."""
    where = locate(mods, mod, sym)
    if where is None or where[1] in mods[where[0]].funcs:
        return where
    init = f"{where[1]}.__init__"
    return (where[0], init) if init in mods[where[0]].funcs else None


def resolve_call(mods: dict[str, Module], mod: Module, cls: str | None,
                 func: ast.expr) -> FuncKey | None:
    if isinstance(func, ast.Name):
        return resolve_symbol(mods, mod.name, func.id)
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return None
    owner, attr = func.value.id, func.attr
    if owner == "self":
        key = f"{cls}.{attr}"
        return (mod.name, key) if cls is not None and key in mod.funcs else None
    bound = mod.binds.get(owner)
    if bound is not None and bound[1] is None and owner not in mod.classes:  # a module
        return resolve_symbol(mods, bound[0], attr)
    where = locate(mods, mod.name, owner)  # a class: its method
    if where is None or where[1] not in mods[where[0]].classes:
        return None
    key = f"{where[1]}.{attr}"
    return (where[0], key) if key in mods[where[0]].funcs else None


def calls_of(mods: dict[str, Module], key: FuncKey) -> list[FuncKey]:
    mod, qual = mods[key[0]], key[1]
    cls = qual.split(".")[0] if "." in qual else None
    calls = sorted((n for n in ast.walk(mods[key[0]].funcs[qual]) if isinstance(n, ast.Call)),
                   key=lambda n: (n.lineno, n.col_offset))
    out = [resolve_call(mods, mod, cls, c.func) for c in calls]
    return [k for k in out if k is not None and k != key]


def walk(mods: dict[str, Module], start: FuncKey, depth: int) -> tuple[list[str], int]:
    """The files of the visited functions in visit order, and the climbs."""
    seen, files, climbs = {start}, [mods[start[0]].rel], 0

    def visit(key: FuncKey, level: int) -> None:
        nonlocal climbs
        if level >= depth:
            return
        for callee in calls_of(mods, key):
            if callee in seen:
                continue
            seen.add(callee)
            files.append(mods[callee[0]].rel)
            climbs += is_climb(mods[key[0]], mods[callee[0]])
            visit(callee, level + 1)

    visit(start, 0)
    return files, climbs


def table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if c.isdigit() else c.ljust(w)
                        for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def report_sizes(mods: dict[str, Module]) -> None:
    total = sum(m.lines for m in mods.values())
    print(f"== 1. Lines per package (total {total} lines, {len(mods)} modules)")
    for title, depth in (("own .py files", None),
                         ("per top-level package, sub-packages included", 2)):
        sums: dict[str, list[int]] = {}
        for m in mods.values():
            pkg = ".".join(m.package.split(".")[:depth])
            row = sums.setdefault("kvrelay (top)" if pkg == "kvrelay" else pkg, [0, 0])
            row[0] += m.lines
            row[1] += 1
        print(f"\n   {title}")
        table(["package", "lines", "modules"], [[k, *v] for k, v in sorted(sums.items())])
    biggest = sorted(mods.values(), key=lambda m: -m.lines)[:5]
    print(f"\n== 2. Largest file: {biggest[0].rel} ({biggest[0].lines} lines)")
    table(["file", "lines"], [[m.rel, m.lines] for m in biggest])


def print_edges(title: str, edges: list[tuple[str, str]]) -> None:
    print(f"\n   {title}: {len(edges)}")
    print("".join(f"    {a} -> {b}\n" for a, b in edges), end="")


def report_imports(mods: dict[str, Module]) -> None:
    graph = import_graph(mods)
    cycles = [c for c in tarjan(graph) if len(c) > 1]
    print(f"\n== 3. Import cycles: {len(cycles)}")
    for i, comp in enumerate(sorted(cycles, key=len, reverse=True), 1):
        print(f"  cycle {i} ({len(comp)} modules): {', '.join(comp)}")
    unlayered = [n for n in sorted(mods) if n != "kvrelay" and layer(n) is None]
    if unlayered:
        print(f"  unlayered modules (exempt): {', '.join(unlayered)}")
    print_edges("imports up the layers or across siblings", against_layers(graph))


def find_starts(mods: dict[str, Module]) -> list[tuple[str, FuncKey | None]]:
    proxies = sorted(n for n, m in mods.items() if "proxy" in n and "Proxy.handle" in m.funcs)
    disagg = mods.get("kvrelay.server.disagg")
    return [("a", (proxies[0], "Proxy.handle") if proxies else None),
            ("b", ("kvrelay.server.disagg", "build_decode")
             if disagg and "build_decode" in disagg.funcs else None)]


def report_walks(mods: dict[str, Module], depth: int) -> None:
    print(f"\n== 4. Walks (depth {depth})")
    for label, start in find_starts(mods):
        if start is None:
            print(f"  walk {label}: start not found")
            continue
        files, climbs = walk(mods, start, depth)
        seq = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
        returns = sum(f in seq[:i] for i, f in enumerate(seq))
        print(f"\n  walk {label}: {start[1]} ({mods[start[0]].rel}), "
              f"{len(files)} functions visited")
        print(f"    rooms {len(set(seq))}, returns {returns}, climbs {climbs}")
        for i, f in enumerate(seq):
            print(f"    {i + 1:3}. {f}{'  (return)' if f in seq[:i] else ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", type=Path,
                        default=Path(__file__).resolve().parent.parent,
                        help="repository root holding kvrelay/ (default: this repository)")
    parser.add_argument("--depth", type=int, default=6, help="walk depth limit (6)")
    args = parser.parse_args(argv)
    if not (args.root / "kvrelay" / "__init__.py").is_file():
        parser.error(f"no kvrelay package under {args.root}")
    mods = load(args.root)
    report_sizes(mods)
    report_imports(mods)
    report_walks(mods, args.depth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
