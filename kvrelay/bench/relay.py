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

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.fake_runner import FakeRunner
from kvrelay.core.kv_port import PoolLeaseBlocks
from kvrelay.core.runner import Batch, SampledToken
from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.sampling_params import SamplingParams


def register(sub: Any) -> None:
    p = sub.add_parser("relay", help="relay answer latency while the prefill engine computes")
    p.add_argument("--step-s", type=float, default=2.0, help="seconds per fake model step")
    p.add_argument("--messages", type=int, default=100, help="HEARTBEATs timed per run")
    p.add_argument("--interval-s", type=float, default=0.02, help="pause between them")
    p.set_defaults(func=run)


class SleepingRunner(FakeRunner):
    """A fake model whose steps take ``step_s`` (or until ``gate`` opens, if given)."""

    def __init__(self, step_s: float, gate: threading.Event | None = None) -> None:
        super().__init__(1000)
        self.step_s = step_s
        self.gate = gate
        self.in_step = threading.Event()
        self.steps_done = 0

    def execute(self, batch: Batch) -> dict[str, SampledToken]:
        self.in_step.set()
        if self.gate is not None:
            self.gate.wait(self.step_s)
        else:
            time.sleep(self.step_s)
        self.steps_done += 1
        return super().execute(batch)


@contextmanager
def prefill_engine(runner: FakeRunner) -> Iterator[tuple[Any, RelayServer]]:
    """A prefill engine loop with its relay server, as ``kvrelay serve --role prefill``
    wires them (kvrelay.server.disagg), on a thread of its own."""
    from kvrelay.server.disagg import PrefillHooks
    from kvrelay.server.engine_loop import EngineLoop

    cfg = SchedulerConfig(num_blocks=256, block_size=16, max_model_len=512)
    pool = BlockPool(cfg.num_blocks)
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id="bench-p")
    server = RelayServer(table, threading.Lock(), RelayServerConfig(compat="bench",
                                                                    transports={"tcp": {}}))
    server.start()
    engine = Engine(cfg, runner, pool=pool, kv_handoff=server.kv_handoff)
    aio = asyncio.new_event_loop()
    aio_thread = threading.Thread(target=aio.run_forever, daemon=True)
    aio_thread.start()
    loop = EngineLoop(engine, hooks=PrefillHooks(server))
    loop.start(aio)
    try:
        yield loop, server
    finally:
        loop.stop(timeout=10.0)
        server.close()
        aio.call_soon_threadsafe(aio.stop)
        aio_thread.join(5)


def keep_busy(loop: Any, n: int) -> None:
    """Queue ``n`` long requests so that the engine is always in a step (not waiting
    for their admission: that happens between steps)."""
    for i in range(n):
        sink: asyncio.Queue[Any] = asyncio.Queue()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        asyncio.run_coroutine_threadsafe(
            loop.add(f"busy{i}", list(range(1, 33)), params, sink), loop._aio)


def time_answers(address: str, messages: int, interval_s: float) -> list[float]:
    """Seconds from sending each HEARTBEAT to its answer."""
    client = RelayClient(compat="bench", transport="tcp", client_id="bench-d")
    try:
        out = []
        for i in range(messages):
            t0 = time.perf_counter()
            client.send(address, P.Heartbeat(i + 1, "bench-p", "no-such-lease", "bench-d",
                                              "a1"))
            reply = client.replies.get(timeout=60)
            out.append(time.perf_counter() - t0)
            assert reply.seq == i + 1, (reply.seq, i + 1)
            time.sleep(interval_s)
        return out
    finally:
        client.close()


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]


def run(args: Any) -> int:
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
