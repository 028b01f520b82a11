"""`kvrelay bench quant` on a tiny mixed-type GGUF: a row per dtype with agreement,
both perplexities and both TPOTs; the agreement measure itself."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvrelay.bench import quant
from kvrelay.model.kernels import ext
from kvrelay.testing.models import write_tiny_gguf

needs_native = pytest.mark.skipif(ext.load() is None, reason="native kernels unavailable")


def test_agreement_counts_the_shared_start() -> None:
    assert quant.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (1, 0.75)


def run_quant(tmp_path: Path, capsys: pytest.CaptureFixture[str], *more: str) -> list[str]:
    """``kvrelay bench quant`` on a tiny mixed-type GGUF and a short text, a few tiny
    measures, with ``more`` flags: its output lines."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=5)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    parser = argparse.ArgumentParser()
    quant.register(parser.add_subparsers())
    args = parser.parse_args(["quant", "--model", str(path), "--text", str(text),
                              "--num-prompts", "3", "--prompt-len", "8", "--output-len", "4",
                              "--ppl-tokens", "40", "--steps", "3", "--rounds", "1",
                              "--threads", "1", *more])
    assert args.func(args) == 0
    return capsys.readouterr().out.strip().splitlines()


@needs_native
def test_bench_quant_prints_a_row_per_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = run_quant(tmp_path, capsys, "--batch", "1", "2")
    rows = [r for r in lines if r.startswith(("float32", "bfloat16"))]
    assert [r.split()[0] for r in rows] == ["float32", "bfloat16"]
    assert sum("batch 2: TPOT none" in r for r in lines) == 2
    f32 = rows[0].split()
    assert f32[1].startswith("native-gguf-") and f32[2] in ("0/3", "1/3", "2/3", "3/3")
    # perplexities: the 8-bit activations of the quantized GEMM move them a little
    assert float(f32[4]) == pytest.approx(float(f32[5]), rel=1e-2)


@needs_native
def test_bench_quant_compares_an_8bit_kv_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--kv-cache-dtype fp8``: both engines serve the GGUF as stored, one with the
    model dtype's KV and one with fp8; the row names both and the perplexity change."""
    lines = run_quant(tmp_path, capsys, "--dtype", "bfloat16", "--kv-cache-dtype", "fp8")
    assert "KV caches: auto against fp8" in lines[0]
    assert "ppl auto" in lines[1] and "ppl fp8" in lines[1] and "auto/fp8" in lines[1]
    row = next(r for r in lines if r.startswith("bfloat16")).split()
    assert row[1].startswith("native-gguf-")
    ppl_auto, ppl_fp8 = float(row[4]), float(row[5])
    # e4m3 keeps 3 mantissa bits: the perplexity moves, a little
    assert ppl_fp8 != ppl_auto and ppl_fp8 == pytest.approx(ppl_auto, rel=5e-2)
    assert float(row[-1].rstrip("%")) == pytest.approx(100 * (ppl_fp8 / ppl_auto - 1),
                                                       abs=0.01)
