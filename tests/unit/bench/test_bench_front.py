"""``kvrelay bench front`` on a tiny load: the table's shape and every request answered
in full (its text checked by the load generator), never its timings."""

from __future__ import annotations

import os

import pytest

from kvrelay.bench.front import find_router
from kvrelay.cli import main


def test_bench_front_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    router = find_router(None)
    cpus = os.sched_getaffinity(0)
    rc = main(["bench", "front", "--concurrency", "1", "4", "--requests", "12",
               "--seconds", "10", "--max-tokens", "4",
               *(["--router", router] if router else ["--no-router"])])
    out = capsys.readouterr().out
    assert rc == 0, out
    fronts = ["none", "kvrelay proxy"] + (["vllm-router"] if router else [])
    rows = [line.split("|")[1:-1] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| front")]
    assert len(rows) == 2 * 2 * len(fronts)  # modes x concurrencies x fronts
    assert {r[0].strip() for r in rows} == set(fronts)
    assert all(r[-1].strip() == "12/12" for r in rows)
    assert out.startswith("machine: ") and "saturation req/s" in out
    assert ("proxy/router" in out) == bool(router)
    # The bench pins itself while it runs, and gives the caller its CPUs back: pytest's
    # thread once stayed on one core, and every engine later tests started with it.
    assert os.sched_getaffinity(0) == cpus
