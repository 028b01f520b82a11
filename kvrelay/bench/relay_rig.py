"""The rig of ``kvrelay bench relay`` (and of its unit test): a prefill engine loop
with its relay server and a fake model that sleeps, and a client that times answers.
Kept apart from the command's module so that parsing the command line imports no torch.
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
from kvrelay.core.kv_port import PoolLeaseBlocks
from kvrelay.core.runner import Batch, SampledToken
from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner


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
