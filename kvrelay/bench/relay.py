"""``kvrelay bench relay``: how long the prefill relay takes to answer while P computes.

A prefill engine loop (the server's own ``EngineLoop`` with the prefill hooks and a
relay server) runs a fake model whose every step sleeps ``--step-s`` seconds, with
requests queued so that it is always mid-step. A decode-side relay client sends
HEARTBEATs (answered by the lease table under the engine lock) and times each
answer. The reference is the same client against the same relay with the engine
idle. Before the relay stopped waiting for the forward, busy answers took up to a
whole step.
"""

from __future__ import annotations

import statistics
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("relay", help="relay answer latency while the prefill engine computes")
    p.add_argument("--step-s", type=float, default=2.0, help="seconds per fake model step")
    p.add_argument("--messages", type=int, default=100, help="HEARTBEATs timed per run")
    p.add_argument("--interval-s", type=float, default=0.02, help="pause between them")
    p.set_defaults(func=run)


def run(args: Any) -> int:
    from kvrelay.bench.relay_rig import SleepingRunner, keep_busy, p99, prefill_engine, time_answers

    rows = []
    for label, busy in (("idle engine", False), (f"engine in {args.step_s:g} s steps", True)):
        runner = SleepingRunner(args.step_s)
        with prefill_engine(runner) as (loop, server):
            if busy:
                keep_busy(loop, 4)
                runner.in_step.wait(30)
            times = time_answers(server.address, args.messages, args.interval_s)
        rows.append((label, statistics.median(times), p99(times), max(times)))
    print(f"{'relay answers':<24} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for label, p50, q99, mx in rows:
        print(f"{label:<24} {p50 * 1e3:8.2f} {q99 * 1e3:8.2f} {mx * 1e3:8.2f}")
    print(f"relay answer p99 ratio busy/idle: {rows[1][2] / rows[0][2]:.2f} "
          f"(busy p99 {rows[1][2] * 1e3:.1f} ms; goal <= 50 ms with {args.step_s:g} s steps)")
    return 0
