"""``kvrelay bench routing``'s workload and report (the run itself starts ten
processes: docs/benchmarks.md has its figures)."""

from __future__ import annotations

import argparse

from kvrelay.bench.routing import Outcome, make_prompts, report
from kvrelay.bench.serve import RequestResult


def test_prompts_interleave_shared_prefixes_with_tails_of_their_own() -> None:
    prompts = make_prompts(10, 4, prefix_len=30, tail_len=5, seed=1)
    heads = [p.split("\nQuestion")[0] for p in prompts]
    assert len(set(prompts)) == 10
    assert [heads.index(h) for h in heads] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert all(len(h.split(": ", 1)[1].split()) == 30 for h in heads)
    # Distinct prefixes differ from their first words, not only deep inside.
    assert len({h.split()[2] + h.split()[3] for h in heads[:4]}) == 4
    assert all(len(p.split("\nQuestion")[1].split(": ", 1)[1].split()) == 5 for p in prompts)


def _results(ttfts_ms: list[float]) -> list[RequestResult]:
    return [RequestResult(ok=True, ttft_s=t / 1e3, output_tokens=8) for t in ttfts_ms]


def test_report_shows_hit_rates_reasons_and_the_ttft_ratio() -> None:
    args = argparse.Namespace(num_requests=3, num_prefixes=4, prefix_len=768, tail_len=16,
                              concurrency=4, output_len=8, dtype="bfloat16", threads=1,
                              num_blocks=None)
    lo = Outcome("least-outstanding", _results([100, 400, 900]),
                 {"prefill": (50.0, 100.0), "decode": (0.0, 0.0)},
                 {"prefill/least_outstanding": 3.0, "prefill/prefix_match": 0.0})
    kv = Outcome("kv-aware", _results([100, 100, 300]),
                 {"prefill": (90.0, 100.0), "decode": (30.0, 40.0)},
                 {"prefill/prefix_match": 2.0, "prefill/least_outstanding": 1.0})
    lines = report(args, [lo, kv]).splitlines()
    assert lines[2].split()[:4] == ["least-outstanding", "3", "50.0%", "n/a"]
    assert lines[2].endswith("prefill/least_outstanding 3")  # zero counts left out
    assert lines[3].split()[:4] == ["kv-aware", "3", "90.0%", "75.0%"]
    assert lines[3].split()[4:7] == ["100.0", "260.0", "166.7"]  # TTFT p50, p90, mean ms
    assert lines[-2] == "TTFT mean ratio kv-aware/least-outstanding: 0.357"
    assert lines[-1] == "TTFT p50 ratio kv-aware/least-outstanding: 0.250"


def test_report_compares_events_with_guesses_when_both_ran() -> None:
    args = argparse.Namespace(num_requests=2, num_prefixes=4, prefix_len=768, tail_len=16,
                              concurrency=4, output_len=8, dtype="bfloat16", threads=1,
                              num_blocks=160)
    hits = {"prefill": (1.0, 2.0), "decode": (1.0, 2.0)}
    outcomes = [Outcome(r, _results(t), hits, {}) for r, t in (
        ("least-outstanding", [400, 400]), ("kv-aware", [200, 200]),
        ("kv-events", [100, 100]))]
    lines = report(args, outcomes).splitlines()
    assert lines[4].split()[0] == "kv-events"
    assert "TTFT p50 ratio kv-events/least-outstanding: 0.250" in lines
    assert lines[-1] == "TTFT p50 ratio kv-events/kv-aware: 0.500"
