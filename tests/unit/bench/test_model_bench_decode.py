"""`kvrelay bench decode` on a tiny model: both GEMMs step, the floor and a row per
batch size are printed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvrelay.bench import decode
from kvrelay.testing.models import write_tiny_hf_model


def test_bench_decode_prints_a_row_per_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_hf_model(tmp_path / "m", seed=6)
    parser = argparse.ArgumentParser()
    decode.register(parser.add_subparsers())
    args = parser.parse_args(["decode", "--model", str(path), "--batch", "1", "3",
                              "--prompt-len", "10", "--steps", "4", "--rounds", "1",
                              "--threads", "1"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "weight-streaming floor" in lines[1]
    assert "KV cache read per step" in lines[2]
    rows = [line.split() for line in lines[-2:]]
    # with the KV cache in the floor, each ratio is below the weights-only one
    assert all(float(r[-1]) < float(r[-2]) for r in rows)
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
