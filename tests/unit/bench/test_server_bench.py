"""``kvrelay bench serve`` against the stand-in server, and its statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.bench.serve import RequestResult, make_prompts, percentiles, summarize
from kvrelay.cli import main
from kvrelay.demo import Answer, stats_table
from tests.unit.server.fakes import make_state, serve_in_thread


def test_percentiles_interpolate() -> None:
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["mean"] == 50.5 and p["p50"] == 50.5
    assert p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert percentiles([])["p99"] == 0.0


def test_summary_counts_only_successes() -> None:
    ok = RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft_s=0.1, e2e_s=0.5,
                       itl_s=[0.1] * 4)
    failed = RequestResult(error="HTTP 500")
    s = summarize([ok, failed], duration=1.0)
    assert (s["successful_requests"], s["failed_requests"]) == (1, 1)
    assert s["output_throughput"] == 5.0 and s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["errors"] == ["HTTP 500"]


def test_prompts_random_or_fixed() -> None:
    fixed = make_prompts("fixed", 3, 10, seed=1)
    assert len(set(fixed)) == 1 and len(fixed[0].split()) == 10
    assert len(set(make_prompts("random", 3, 10, seed=1))) == 3


@pytest.mark.parametrize("mode", [["--concurrency", "4"], ["--request-rate", "200"]])
def test_bench_against_the_server(tmp_path: Path, mode: list[str]) -> None:
    out = tmp_path / "result.json"
    with serve_in_thread(make_state(num_blocks=256, max_model_len=256)) as url:
        rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "12", *mode,
                   "--input-len", "16", "--output-len", "8", "--no-progress",
                   "--save-result", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["successful_requests"] == 12 and s["total_output_tokens"] == 96
    assert s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"] > 0
    assert result["model"] == "tiny" and len(result["requests"]) == 12


def test_demo_stats_table() -> None:
    table = stats_table([Answer("q", "a", True, 10, 21, 0.1, 1.1)])
    assert "TTFT" in table and "20.0" in table  # 20 tokens after the first in 1 s


def test_free_port_never_gives_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two picks before either server binds (a prefill engine's HTTP and relay ports)
    were both free and, once, the same: the engine then failed to bind its second
    server. With the random pick pinned to one free port, the second call must answer
    another port (without the record of answers given, both calls return it)."""
    import random

    from kvrelay import demo

    first = demo.free_port()  # a free port below the ephemeral range, now handed out
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: first)
    second = demo.free_port()
    assert second != first
    third = demo.free_port()
    assert len({first, second, third}) == 3
