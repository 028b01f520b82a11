"""``kvrelay bench prefix`` on a tiny model: both engines, identical outputs, a ratio."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvrelay.bench import prefix
from kvrelay.model.testing import write_tiny_hf_model


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
