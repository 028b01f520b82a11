"""The environment knobs (issue 43 item 8): docs/environment.md lists exactly the
registry of kvrelay/env.py plus the build and test knobs; every KVRELAY_ name in the
package is registered and read through kvrelay/env.py; a bad value is an error naming
the variable."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay import env
from kvrelay.relay.transports.base import injected_delay

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"KVRELAY_[A-Z0-9_]+")

PACKAGE_KNOBS = {
    "KVRELAY_ALLOW_SLOW_BF16", "KVRELAY_AMX_GEMM", "KVRELAY_API_KEY",
    "KVRELAY_FAULT_ANSWER_DELAY_S", "KVRELAY_FAULT_TRANSFER_DELAY_S",
    "KVRELAY_FAULT_VLLM_HOLD_DELAY_S", "KVRELAY_FAULT_VLLM_RAISE", "KVRELAY_HUGEPAGES",
    "KVRELAY_KERNELS", "KVRELAY_KV_POPULATE", "KVRELAY_NATIVE_GEMM", "KVRELAY_NATIVE_ISA",
    "KVRELAY_NIXL_PROGRESS_DELAY_US", "KVRELAY_OMP_WAIT_POLICY", "KVRELAY_PREFILL_AMX",
    "KVRELAY_PREFILL_SDPA", "KVRELAY_RELAY_SECRET",
}
BUILD_AND_TEST_KNOBS = {
    "KVRELAY_BUILD_NATIVE", "KVRELAY_REQUIRE_NATIVE", "KVRELAY_REQUIRE_VLLM", "KVRELAY_VENV",
    "KVRELAY_VLLM_MODEL", "KVRELAY_VLLM_SLOW", "KVRELAY_VLLM_TOY_PROXY", "KVRELAY_VLLM_VENV",
    "KVRELAY_HARNESS_SEEDS", "KVRELAY_VLLM34_TRIM", "KVRELAY_VLLM34_VENV", "KVRELAY_WHEELS",
    "KVRELAY_HARNESS_TP_SEEDS", "KVRELAY_HARNESS_HETERO_SEEDS",
    "KVRELAY_VLLM_TP_FULL",
}


def docs_table() -> dict[str, list[str]]:
    """docs/environment.md's rows by name: the cells after the name."""
    rows: dict[str, list[str]] = {}
    for line in (ROOT / "docs" / "environment.md").read_text().splitlines():
        if line.startswith("| `KVRELAY_"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = cells[0].strip("`")
            assert name not in rows, f"{name} is in the table twice"
            rows[name] = cells[1:]
    return rows


def test_the_docs_table_lists_the_registry_and_the_build_and_test_knobs() -> None:
    assert set(env.KNOBS) == PACKAGE_KNOBS
    rows = docs_table()
    assert set(rows) == PACKAGE_KNOBS | BUILD_AND_TEST_KNOBS
    for name, (type_, _default, what, read_by) in rows.items():
        assert what, f"{name}: no description"
        if name in PACKAGE_KNOBS:
            assert read_by.startswith("package"), name
            assert type_.split(":")[0] == env.KNOBS[name].type, name
        else:
            assert read_by.startswith(("build", "tests")), name


def package_sources() -> list[Path]:
    return sorted((ROOT / "kvrelay").rglob("*.py"))


def test_every_kvrelay_name_in_the_package_is_registered() -> None:
    found: set[str] = set()
    for path in package_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(NAME.findall(node.value))
    for path in (ROOT / "kvrelay").rglob("*.cpp"):  # KVRELAY_NATIVE_ISA, read in C++
        found |= set(NAME.findall(path.read_text()))
    assert {"KVRELAY_KERNELS", "KVRELAY_NATIVE_ISA"} <= found
    assert found - set(env.KNOBS) == set(), "KVRELAY_ names missing from kvrelay/env.py"


def direct_environ_uses(source: str) -> list[str]:
    """``line: NAME`` for each os.environ / os.getenv use of a KVRELAY_ name, given as a
    string or as a name bound to one (``X = "KVRELAY_..."; os.environ.get(X)``)."""
    tree = ast.parse(source)
    bound = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
             for t in n.targets if isinstance(t, ast.Name)}

    def key(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value: str | None = node.value
        else:
            value = bound.get(node.id) if isinstance(node, ast.Name) else None
        return value if value and value.startswith("KVRELAY_") else None

    def is_environ(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ"
                and isinstance(node.value, ast.Name) and node.value.id == "os") or (
            isinstance(node, ast.Name) and node.id == "environ")

    out = []
    for node in ast.walk(tree):
        keys: list[ast.expr] = []
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and is_environ(f.value)) or (
                    isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id == "os" and f.attr in ("getenv", "putenv", "unsetenv")) or (
                    isinstance(f, ast.Name) and f.id == "getenv"):
                keys = [node.args[0]]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys = [node.left]
        out += [f"{node.lineno}: {k}" for k in map(key, keys) if k]
    return sorted(out, key=lambda s: int(s.split(":")[0]))


def test_the_checker_finds_direct_reads() -> None:
    source = (
        'import os\n'
        'ALLOW = "KVRELAY_ALLOW_SLOW_BF16"\n'
        'a = os.environ.get(ALLOW) == "1"\n'
        'b = os.getenv("KVRELAY_KERNELS")\n'
        'c = os.environ["KVRELAY_API_KEY"]\n'
        'd = "KVRELAY_HUGEPAGES" in os.environ\n'
        'os.environ.setdefault("KVRELAY_KERNELS", "torch")\n'
        'e = os.environ.get("OMP_WAIT_POLICY")\n'
    )
    assert direct_environ_uses(source) == [
        "3: KVRELAY_ALLOW_SLOW_BF16", "4: KVRELAY_KERNELS", "5: KVRELAY_API_KEY",
        "6: KVRELAY_HUGEPAGES", "7: KVRELAY_KERNELS"]


def test_only_kvrelay_env_touches_kvrelay_variables() -> None:
    uses = {str(p.relative_to(ROOT)): u for p in package_sources()
            if p != ROOT / "kvrelay" / "env.py"
            if (u := direct_environ_uses(p.read_text()))}
    assert uses == {}, "read these through kvrelay.env"


def test_build_and_test_sources_name_only_documented_knobs() -> None:
    files = [ROOT / "setup.py", ROOT / "Makefile"]
    files += [p for d in ("scripts", "tests") for p in (ROOT / d).rglob("*") if p.is_file()]
    named = {n for p in files for n in NAME.findall(p.read_bytes().decode(errors="ignore"))}
    assert {"KVRELAY_BUILD_NATIVE", "KVRELAY_REQUIRE_VLLM", "KVRELAY_VLLM_VENV"} <= named
    assert named - set(docs_table()) == set(), "KVRELAY_ names missing from the docs table"


def test_unset_or_empty_is_the_default_and_values_parse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVRELAY_HUGEPAGES", "KVRELAY_KERNELS", "KVRELAY_NIXL_PROGRESS_DELAY_US",
                 "KVRELAY_API_KEY", "KVRELAY_PREFILL_SDPA"):
        monkeypatch.delenv(name, raising=False)
    assert env.get("KVRELAY_HUGEPAGES") is True
    assert env.get("KVRELAY_KERNELS") == "auto"
    assert env.get("KVRELAY_NIXL_PROGRESS_DELAY_US") == 200
    assert env.get("KVRELAY_API_KEY") is None
    assert env.get("KVRELAY_PREFILL_SDPA") is None
    assert env.get("KVRELAY_KERNELS", None) is None
    monkeypatch.setenv("KVRELAY_HUGEPAGES", "")
    assert env.get("KVRELAY_HUGEPAGES") is True
    monkeypatch.setenv("KVRELAY_HUGEPAGES", "0")
    assert env.get("KVRELAY_HUGEPAGES") is False
    monkeypatch.setenv("KVRELAY_PREFILL_SDPA", "1")
    assert env.get("KVRELAY_PREFILL_SDPA") is True
    monkeypatch.setenv("KVRELAY_KERNELS", "Torch")
    assert env.get("KVRELAY_KERNELS") == "torch"
    monkeypatch.setenv("KVRELAY_NIXL_PROGRESS_DELAY_US", "50")
    assert env.get("KVRELAY_NIXL_PROGRESS_DELAY_US") == 50
    monkeypatch.setenv("KVRELAY_FAULT_TRANSFER_DELAY_S", "0.25")
    assert injected_delay() == 0.25
    monkeypatch.setenv("KVRELAY_API_KEY", "s3cret")
    assert env.get("KVRELAY_API_KEY") == "s3cret"


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("KVRELAY_HUGEPAGES", "off", "0 or 1"),
    ("KVRELAY_ALLOW_SLOW_BF16", "true", "0 or 1"),
    ("KVRELAY_KERNELS", "gpu", "one of auto, native, torch"),
    ("KVRELAY_NIXL_PROGRESS_DELAY_US", "1.5", "an integer"),
    ("KVRELAY_FAULT_ANSWER_DELAY_S", "soon", "a number"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str, allowed: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name}='{value}': allowed: {allowed}")):
        env.get(name)


def test_a_call_site_reports_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_FAULT_TRANSFER_DELAY_S", "5s")
    with pytest.raises(ValueError, match="KVRELAY_FAULT_TRANSFER_DELAY_S='5s'"):
        injected_delay()


def test_an_unregistered_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        env.get("KVRELAY_not_registered")
    with pytest.raises(KeyError):
        env.setenv("OMP_WAIT_POLICY", "PASSIVE")


def test_setenv_and_overridden_check_the_value_and_restore(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_KERNELS", "native")
    with pytest.raises(ValueError, match="KVRELAY_KERNELS='gpu'"):
        env.setenv("KVRELAY_KERNELS", "gpu")
    with env.overridden("KVRELAY_KERNELS", "torch"):
        assert os.environ["KVRELAY_KERNELS"] == "torch"
    assert os.environ["KVRELAY_KERNELS"] == "native"
    with env.overridden("KVRELAY_KERNELS", None):
        assert os.environ["KVRELAY_KERNELS"] == "native"
    monkeypatch.delenv("KVRELAY_KERNELS")
    with env.overridden("KVRELAY_KERNELS", "torch"):
        assert env.get("KVRELAY_KERNELS") == "torch"
    assert "KVRELAY_KERNELS" not in os.environ
    env.setenv("KVRELAY_KERNELS", "torch")  # monkeypatch restores the unset variable
    assert os.environ["KVRELAY_KERNELS"] == "torch"


def test_a_bad_wait_policy_warns_and_import_goes_on() -> None:
    """Read as kvrelay is imported: a bad value must not break ``import kvrelay``."""
    code = ("import kvrelay\nfrom kvrelay.model.kernels import choice\n"
            "print(choice._wait.policy, choice._wait.requested)\n")
    clean = {k: v for k, v in os.environ.items() if "OMP" not in k}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=clean | {"KVRELAY_OMP_WAIT_POLICY": "spin"}, check=True)
    assert out.stdout.split() == ["PASSIVE", "passive"]
    assert "KVRELAY_OMP_WAIT_POLICY='spin': allowed: one of active, passive, auto" in out.stderr


def test_a_bad_knob_is_the_commands_usage_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A value that does not parse, read deep in a command (here while loading the
    model), is one line and exit 2, as a bad flag is: not a traceback."""
    from kvrelay.cli import main
    from kvrelay.testing.models import write_tiny_hf_model

    d = write_tiny_hf_model(tmp_path / "m")
    monkeypatch.setenv("KVRELAY_HUGEPAGES", "off")
    assert main(["generate", "--model", str(d), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvrelay generate: KVRELAY_HUGEPAGES='off': allowed: 0 or 1 (or unset)"], err


def test_an_empty_api_key_is_refused_not_served_open(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """KVRELAY_API_KEY set but empty (a secret that did not populate) stops serve before
    it loads anything: an empty key must not mean no key at all."""
    from kvrelay.cli import main

    monkeypatch.setenv("KVRELAY_API_KEY", "")
    assert main(["serve", "/nonexistent-model"]) == 2
    assert "KVRELAY_API_KEY is set but empty" in capsys.readouterr().err
    assert env.set_but_empty("KVRELAY_API_KEY") and env.get("KVRELAY_API_KEY") is None
