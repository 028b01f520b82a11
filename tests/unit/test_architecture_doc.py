"""A reader's test: docs/ARCHITECTURE.md is the map of the tree (issue 43, "A map first").

It fails when the map misses a package directory under kvrelay/, misses a state machine
that has a transition table in the code, or names a file that is not there; when a package's
``__init__.py`` has no docstring or opens with more than three lines; and when a
``python -m kvrelay...`` command in the docs names a module that does not exist. Transition
tables are found in the code, not listed here: a module-level dict or set whose keys (or
elements) are tuples starting with a member of an enum, e.g. ``(S.WAITING, E.SCHEDULE)``.
The enum of that first member is the machine's state."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvrelay

PKG = Path(kvrelay.__file__).resolve().parent
REPO = PKG.parent
DOCS = REPO / "docs"
MAP = DOCS / "ARCHITECTURE.md"

# Packages whose __init__.py had no docstring when this test was written (the module files
# are another change's to edit). Strict: once one has its docstring, drop it from here.
# The machines the table finder must find (so a finder that finds nothing fails), and
# state kept without a table that the map names too: (class, file under kvrelay/).
TABLED = {("RequestState", "core/lifecycle.py"), ("LeaseState", "relay/lease.py"),
          ("Phase", "relay/receiver.py"), ("LegState", "proxy/legs.py")}
UNTABLED = {("TransferState", "relay/transports/base.py"), ("DrainState", "wire/drain.py")}
SUMMARY_LINES = 3


def packages() -> list[str]:
    """Every package directory, as ``kvrelay/a/b``."""
    return sorted(p.parent.relative_to(REPO).as_posix() for p in PKG.rglob("__init__.py")
                  if "__pycache__" not in p.parts)


def map_text() -> str:
    return MAP.read_text()


def modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def enum_classes() -> dict[str, set[str]]:
    """Enum class name -> the files (under kvrelay/) that define one by that name."""
    out: dict[str, set[str]] = {}
    for path in modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(
                    (b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                     ).endswith("Enum") for b in node.bases):
                out.setdefault(node.name, set()).add(path.relative_to(PKG).as_posix())
    return out


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level ``S, E = RequestState, Event`` and ``S = RequestState``."""
    out: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Name):
                out[target.id] = node.value.id
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts, strict=False):
                    if isinstance(t, ast.Name) and isinstance(v, ast.Name):
                        out[t.id] = v.id
    return out


def _entries(value: ast.expr | None) -> list[ast.expr]:
    """The keys of a dict literal, or the elements of a set/frozenset literal."""
    if isinstance(value, ast.Dict):
        return [k for k in value.keys if k is not None]
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("frozenset", "set") \
            and value.args:
        value = value.args[0]
    if isinstance(value, (ast.Set, ast.List, ast.Tuple)):
        return list(value.elts)
    return []


def transition_tables() -> set[tuple[str, str, str]]:
    """(state enum, its file under kvrelay/, table name) for every transition table."""
    enums = enum_classes()
    found: set[tuple[str, str, str]] = set()
    for path in modules():
        tree = ast.parse(path.read_text())
        alias = _aliases(tree)
        for node in tree.body:
            target: ast.expr
            value: ast.expr | None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            else:
                continue
            if not isinstance(target, ast.Name):
                continue
            for entry in _entries(value):
                if not (isinstance(entry, ast.Tuple) and len(entry.elts) >= 2):
                    continue
                first = entry.elts[0]
                if isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name):
                    name = alias.get(first.value.id, first.value.id)
                    for file in enums.get(name, ()):
                        found.add((name, file, target.id))
    return found


def named_on_one_line(text: str, cls: str, file: str) -> bool:
    return any(f"`{cls}`" in line and file in line for line in text.splitlines())


def test_the_map_names_every_package() -> None:
    text = map_text()
    missing = [p for p in packages() if p != "kvrelay"
               and not re.search(rf"(?<![\w/]){re.escape(p)}/?(?![\w/])", text)]
    assert not missing, f"docs/ARCHITECTURE.md does not name these packages: {missing}"


def test_the_table_finder_finds_the_known_machines() -> None:
    found = {(cls, file) for cls, file, _ in transition_tables()}
    assert found >= TABLED, f"not found as transition tables: {sorted(TABLED - found)}"


def test_the_map_names_every_state_machine_with_its_file() -> None:
    text = map_text()
    tabled = {(cls, file) for cls, file, _ in transition_tables()}
    missing = sorted(m for m in tabled | UNTABLED if not named_on_one_line(text, *m))
    assert not missing, (
        "docs/ARCHITECTURE.md, 'State tables', lacks a line naming each of these enums "
        f"(in backticks) with its file: {missing}")


def test_the_untabled_states_exist_where_the_map_says() -> None:
    for cls, file in UNTABLED:
        assert re.search(rf"^class {cls}\b", (PKG / file).read_text(), re.M), (cls, file)


def test_every_file_the_map_names_exists() -> None:
    """Backticked ``x.py`` and ``dir/`` names: in the package of the bullet that names them,
    under kvrelay/ or the repository, or (a bare file name) anywhere under kvrelay/ or
    tests/ (so a test file may move between the sub-folders of tests/unit)."""
    missing = []
    base: Path | None = None
    for line in map_text().splitlines():
        if line.startswith("- "):
            m = re.match(r"- `kvrelay/([\w/]+)/`", line)
            base = PKG / m.group(1) if m else PKG if "at the root" in line else None
        elif not line.startswith("  "):
            base = None
        for token in re.findall(r"`([\w./]+)`", line):
            if not (token.endswith(".py") or token.endswith("/")):
                continue
            candidates = [b / token for b in (base, PKG, REPO) if b is not None]
            if any(c.exists() for c in candidates):
                continue
            if "/" not in token and any(any(d.rglob(token)) for d in (PKG, REPO / "tests")):
                continue
            missing.append(token)
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


def _summary(path: Path) -> str | None:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return None if doc is None else doc.split("\n\n")[0]


@pytest.mark.parametrize("package", packages())
def test_every_package_opens_with_a_short_docstring(package: str) -> None:
    summary = _summary(REPO / package / "__init__.py")
    assert summary, f"{package}/__init__.py has no docstring"
    lines = summary.strip().splitlines()
    assert len(lines) <= SUMMARY_LINES, (
        f"{package}/__init__.py: the docstring's first paragraph is {len(lines)} lines "
        f"(at most {SUMMARY_LINES})")


def test_every_python_m_command_in_the_docs_names_a_module() -> None:
    missing = []
    for doc in sorted([*DOCS.rglob("*.md"), REPO / "README.md"]):
        for name in re.findall(r"python3? -m (kvrelay(?:\.\w+)*)", doc.read_text()):
            rel = Path(*name.split("."))
            if not ((REPO / rel).with_suffix(".py").exists()
                    or (REPO / rel / "__main__.py").exists()):
                missing.append(f"{doc.relative_to(REPO)}: python -m {name}")
    assert not missing, missing
