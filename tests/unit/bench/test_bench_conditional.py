"""``kvrelay bench conditional``'s workload and report (the run itself starts a 1P1D
cluster per mode: docs/benchmarks.md has its figures)."""

from __future__ import annotations

import argparse

from kvrelay.bench.conditional import Outcome, make_prompts, report
from kvrelay.bench.serve import RequestResult


def args(**kw: object) -> argparse.Namespace:
    base = {"num_requests": 200, "long_fraction": 0.5, "num_prefixes": 3, "prefix_len": 40,
            "tail_len": 5, "short_len": 12, "seed": 1, "concurrency": 4, "output_len": 8,
            "dtype": "bfloat16", "threads": 1, "local_prefill_queue_tokens": 256}
    return argparse.Namespace(**{**base, **kw})


def test_the_workload_mixes_short_prompts_and_long_ones_on_shared_documents() -> None:
    prompts = make_prompts(args())
    assert prompts == make_prompts(args())  # seeded: every mode gets the same
    long = [p for p in prompts if p.startswith("Document")]
    short = [p for p in prompts if p.startswith("Question")]
    assert len(long) + len(short) == 200 and 70 < len(long) < 130
    docs = {p.split("\nQuestion")[0] for p in long}
    assert len(docs) == 3 and all(len(d.split(": ", 1)[1].split()) == 40 for d in docs)
    assert len(set(long)) == len(long)  # each question its own
    lengths = {len(p.split(": ", 1)[1].split()) for p in short}
    assert min(lengths) == 4 and max(lengths) == 12
    assert all(p.startswith("Question") for p in make_prompts(args(long_fraction=0.0)))


def _results(ttfts_ms: list[float]) -> list[RequestResult]:
    return [RequestResult(ok=True, ttft_s=t / 1e3, e2e_s=2 * t / 1e3, output_tokens=8)
            for t in ttfts_ms]


def test_report_shows_each_mode_and_the_ratio_to_the_better_of_the_two() -> None:
    outcomes = [
        Outcome("always", 256, _results([100, 200, 1000]), {"prefill/least_outstanding": 3,
                "decode/least_outstanding": 3}, 3 * 2**20),
        Outcome("never", 256, _results([300, 300, 500]), {"prefill/local_always": 3}, 0),
        Outcome("conditional", 64, _results([100, 250, 400]),
                {"prefill/local_short_prompt": 2, "prefill/local_cached": 0,
                 "prefill/least_outstanding": 1}, 2**20),
    ]
    lines = report(args(num_requests=3), outcomes).splitlines()
    assert lines[2].split()[:7] == ["always-disaggregated", "3", "200.0", "840.0", "984.0",
                                    "866.7", "3.0"]
    assert lines[2].endswith("least_outstanding 3")  # the prefill's reasons only
    assert lines[3].split()[:2] == ["always-local", "3"]
    assert lines[4].split()[:3] == ["conditional", "64", "3"]
    assert lines[4].endswith("least_outstanding 1, local_short_prompt 2")  # zeros left out
    # p50: 250 / min(200, 300); p99: 397 / min(984, 496).
    assert lines[-1] == "TTFT ratio conditional 64 / better of the two: p50 1.250, p99 0.800"
