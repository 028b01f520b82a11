"""`kvrelay bench offline` on a tiny model: both engines run, the ratio is printed last."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvrelay.bench import offline
from kvrelay.testing.models import write_tiny_hf_model

pytest.importorskip("transformers")


def test_bench_offline_prints_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_hf_model(tmp_path / "m", seed=6)
    parser = argparse.ArgumentParser()
    offline.register(parser.add_subparsers())
    argv = ["offline", "--model", str(path), "--dtype", "float32", "--num-prompts", "3"]
    args = parser.parse_args([*argv, "--prompt-len", "12", "--output-len", "6", "--threads", "1"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("throughput ratio kvrelay/transformers: ")
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0
    assert "identical outputs: 3/3" in lines
