"""``kvrelay bench core``: engine-core cost per step and per request.

Measures schedule + output processing (the scheduler and the lifecycle, the fake
runner's time excluded) for decode steps at 100, 1,000 and 10,000 running
requests. The cost per request must not grow with the number of requests: the
last line is the ratio of the per-request cost at 10,000 to that at 100.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.core.engine import Engine
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner


def register(sub: Any) -> None:
    p = sub.add_parser("core", help="scheduler + lifecycle cost per step (fake runner)")
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--steps", type=int, default=30, help="measured decode steps per size")
    p.set_defaults(func=run)


def measure_step_cost(num_requests: int, steps: int, block_size: int = 16) -> float:
    """Seconds of core time per decode step with ``num_requests`` running."""
    prompt_len, max_tokens = 8, steps + 8
    cfg = SchedulerConfig(
        num_blocks=num_requests * (-(-(prompt_len + max_tokens) // block_size)),
        block_size=block_size,
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * prompt_len,
        max_model_len=prompt_len + max_tokens,
    )
    runner = FakeRunner(block_size=block_size)
    engine = Engine(cfg, runner)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [1] * prompt_len, params)
    engine.step()  # the prefill of everyone
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = engine.schedule()
        t1 = time.perf_counter()
        assert batch is not None and len(batch.requests) == num_requests
        sampled = runner.execute(batch)
        t2 = time.perf_counter()
        engine.complete(batch, sampled)
        engine.take_outputs()
        t3 = time.perf_counter()
        best = min(best, (t1 - t0) + (t3 - t2))
    return best


def measure_pool_ops(num_blocks: int = 100_000, rounds: int = 20) -> float:
    """Block allocate + free operations per second (one block each)."""
    pool = BlockPool(num_blocks)
    owner = request_owner("bench")
    t0 = time.perf_counter()
    for _ in range(rounds):
        ids = [pool.allocate(1, owner)[0] for _ in range(num_blocks // 10)]
        for b in ids:
            pool.free([b], owner)
    elapsed = time.perf_counter() - t0
    return 2 * rounds * (num_blocks // 10) / elapsed


def run(args: argparse.Namespace) -> int:
    print(f"{'running':>8} {'step ms':>9} {'us/request':>11}")
    per_request: dict[int, float] = {}
    for n in args.sizes:
        cost = measure_step_cost(n, args.steps)
        per_request[n] = cost / n
        print(f"{n:>8} {cost * 1e3:>9.3f} {cost / n * 1e6:>11.3f}")
    print(f"pool allocate/free: {measure_pool_ops() / 1e6:.2f} M ops/s (one block per op)")
    lo, hi = min(per_request), max(per_request)
    print(f"per-request step cost ratio {hi}/{lo}: {per_request[hi] / per_request[lo]:.2f}")
    return 0
