"""``kvrelay bench prefix`` on a tiny model: both engines, identical outputs, a ratio."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvrelay.bench import prefix
from kvrelay.testing.models import write_tiny_hf_model


def test_bench_prefix_prints_identical_outputs_and_a_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_hf_model(tmp_path / "llama", seed=3)
    args = argparse.Namespace(model=str(path), dtype="float32", threads=1, num_requests=3,
                              prefix_len=40, tail_len=8, output_len=3, seed=0)
    assert prefix.run(args) == 0
    out = capsys.readouterr().out
    assert "identical outputs: 3/3" in out
    found = re.search(r"hits: (\d+)/(\d+) tokens", out)
    assert found is not None
    # Queries: the warm-up (64 + 8 tokens) and three prompts of 40 + 8. Hits: requests 2
    # and 3 find the two full 16-token blocks of the shared 40-token prefix.
    assert (int(found[1]), int(found[2])) == (2 * 32, 72 + 3 * 48)
    assert re.search(r"TTFT p50 ratio cached/uncached: \d+\.\d+$", out.strip())


@pytest.mark.e2e
def test_bench_prefix_through_1p1d_moves_only_the_tails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--pd``: two real 1P1D deployments behind proxies; with caching, D's later
    requests receive only their tail's blocks."""
    path = write_tiny_hf_model(tmp_path / "llama", seed=3)
    args = argparse.Namespace(model=str(path), dtype="float32", threads=1, num_requests=3,
                              prefix_len=40, tail_len=8, output_len=3, seed=0, pd=True,
                              kv_transport="auto")
    assert prefix.run(args) == 0
    out = capsys.readouterr().out
    assert "identical outputs: 3/3" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("on ", "off "))}
    first_off, later_off = (float(x.replace(",", "")) for x in rows["off"][2:4])
    first_on, later_on = (float(x.replace(",", "")) for x in rows["on"][2:4])
    assert first_on == first_off > 0
    # 48 prompt tokens in blocks of 16: 3 blocks without caching, and with it the
    # last one only (the two full blocks of the shared 40-token prefix are cached).
    assert later_off == first_off and later_on == first_on / 3
    assert re.search(r"hits \(decode\): (\d+)/", out)
    assert re.search(r"TTFT p50 ratio cached/uncached: \d+\.\d+$", out.strip())
