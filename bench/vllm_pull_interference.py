"""Does a pull stall D's running decodes? vLLM 1P1D with KvRelayConnector: D decodes a
steady background of streamed requests (colocated on D, no params) while P/D requests
with long prompts pull their KV into D, against the same background with no pulls, in
one run (issue 40: the pulls' TPOT cost should stay within their copy time).

    PYTHONPATH=. KVRELAY_VLLM_VENV=/tmp/kvrelay-vllm/v-vllm .venv/bin/python \\
        bench/vllm_pull_interference.py [--transport nixl] [--streams 4] [--json out.json]

Phases, alternated (A, B, A, B): A, the background alone; B, the background plus one
P/D request after another (P: the prompt with ``do_remote_decode``; D: the prompt with
P's params, ``max_tokens`` 1). The figure: the background's token gaps (TPOT) in each
phase, p50 and p99, and the pulls' copy time by D's log (``read``: the READ alone;
``load``: ACQUIRE answered to commit confirmed). Engines: SmolLM2-135M fp32, one core
each (``taskset -a``: P core 0, D core 1), a KV cache of 150 MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.vllm_connectors import KVRELAY_FIRST, first_leg, prompt, start, stop, transfer_ms
from tests.vllm.pair import VllmEngine, missing

BACKGROUND_TOKENS = 96


def background(url: str, gaps: list[float], stop_at: threading.Event) -> None:
    """One streamed request after another until ``stop_at``; each token gap in ms."""
    body = {"model": "smol", "prompt": "Write a long story about the sea.",
            "max_tokens": BACKGROUND_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    while not stop_at.is_set():
        last = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(1000 * (now - last))
                    last = now


def phase(p: VllmEngine, d: VllmEngine, streams: int, seconds: float, pulls: bool,
          words: int) -> dict[str, Any]:
    gaps: list[float] = []
    done = threading.Event()
    threads = [threading.Thread(target=background, args=(d.url, gaps, done))
               for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the background reaches its steady batch
    del gaps[:]
    n_pulls = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pulls:
            text = prompt(n_pulls, words)
            params = first_leg(p, text, KVRELAY_FIRST)
            httpx.post(f"{d.url}/v1/completions", timeout=300, json={
                "model": "smol", "prompt": text, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": params}).raise_for_status()
            n_pulls += 1
        else:
            time.sleep(0.2)
    done.set()
    for t in threads:
        t.join(300)
    gaps.sort()
    return {"gaps": len(gaps), "pulls": n_pulls,
            "tpot_p50_ms": round(statistics.median(gaps), 2),
            "tpot_p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="nixl", choices=["tcp", "nixl"])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=40.0, help="per phase")
    ap.add_argument("--words", type=int, default=360, help="pulled prompts (~1.2 tokens a word)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if missing():
        raise SystemExit(missing())
    tmp = Path(tempfile.mkdtemp(prefix="kvrelay-interference-"))
    extra = {"kv_transport": args.transport, "lease_timeout": 30}
    p = VllmEngine("prefill", "kv_producer", tmp / "p.log", dict(extra),
                   env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    d = VllmEngine("decode", "kv_consumer", tmp / "d.log", dict(extra),
                   env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    out: dict[str, Any] = {"transport": args.transport, "streams": args.streams}
    try:
        start([p, d])
        first_leg(p, prompt(-1, args.words), KVRELAY_FIRST)  # P's first lease: connects
        skip = len(d.log.read_text(errors="replace"))
        for round_ in range(2):
            out[f"A{round_}"] = phase(p, d, args.streams, args.seconds, False, args.words)
            out[f"B{round_}"] = phase(p, d, args.streams, args.seconds, True, args.words)
            print(json.dumps({k: out[k] for k in (f"A{round_}", f"B{round_}")}), flush=True)
        load_ms, n, phases = transfer_ms(d, "kvrelay", skip)
        out.update(load_ms=load_ms, transfers=n, phases_ms=phases)
        a = max(out["A0"]["tpot_p99_ms"], out["A1"]["tpot_p99_ms"])
        b = max(out["B0"]["tpot_p99_ms"], out["B1"]["tpot_p99_ms"])
        copy = phases.get("read") or 0.0
        out["p99_increase_ms"] = round(b - a, 2)
        out["copy_ms"] = round(copy, 2)
        out["increase_over_copy"] = round((b - a) / copy, 2) if copy else None
    finally:
        stop([p, d])
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
