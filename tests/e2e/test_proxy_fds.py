"""The proxy's open fds come back to their warm-up level after clients leave at every phase.

Issue 21 item 7: the 30-minute soak saw the proxy's fds climb within each proxy life (15 ->
29 over 593 s) while its RSS stayed flat. Real processes: P, D and the proxy on the tiny
model; clients leave at every phase (before the proxy has P's connection, while P
prefills, while D streams: after the first chunk), some while P or D is stopped
(SIGSTOP), then steady load again. Once the load settles the proxy must hold no more
sockets than after warm-up (its keep-alive pool, bounded by the concurrency) and no socket
its peer has closed (CLOSE_WAIT: a connection nobody reads or closes any more).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay.bench.soak import tcp_states
from tests.e2e.cluster import Cluster, Proc, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONCURRENCY = 3
SLACK = 2  # fds over the warm-up level allowed: a pooled connection or two in handover


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.model.testing import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("proxy-fds-logs"))
    try:
        procs = {"p": c.prefill("prefill"), "d": c.decode("decode", "shm")}
        for p in procs.values():
            p.wait_healthy()
        procs["proxy"] = c.proxy([procs["p"]], [procs["d"]]).wait_healthy()
        yield procs
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def fds(p: Proc) -> int:
    assert p.proc is not None
    return len(os.listdir(f"/proc/{p.proc.pid}/fd"))


def close_wait(p: Proc) -> float:
    assert p.proc is not None
    return tcp_states(p.proc.pid).get("tcp_close_wait", 0.0)


async def ask(url: str, model: str, i: int, leave: float | str | None) -> None:
    """One request; ``leave``: None (read it all), seconds after sending, or "chunk"
    (after the first streamed chunk)."""
    body = {"model": model, "prompt": f"prefix {i % 4} of the soak {i}", "max_tokens": 16,
            "stream": leave == "chunk" or i % 2 == 0}
    async with httpx.AsyncClient(timeout=60) as c:
        if leave is None:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
        elif leave == "chunk":
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    break  # leave during D's stream
        else:
            task = asyncio.ensure_future(c.post(url + "/v1/completions", json=body))
            await asyncio.sleep(float(leave))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # or it was done by then
                await task


async def steady(url: str, model: str, rounds: int) -> None:
    for r in range(rounds):
        await asyncio.gather(*(ask(url, model, r * CONCURRENCY + i, None)
                               for i in range(CONCURRENCY)))


async def storm(cluster: dict[str, Proc], model: str) -> None:
    rng = random.Random(21)
    url = cluster["proxy"].url
    leaves: list[float | str] = [0.0, 0.001, 0.005, 0.02, 0.05, 0.1, 0.3, "chunk"]
    for rnd in range(12):
        await asyncio.gather(*(ask(url, model, rnd * 12 + i, rng.choice(leaves))
                               for i in range(12)))
        if rnd % 4 == 3:  # leave while P (then D) is stopped: the proxy's calls hang
            victim = cluster["p"] if rnd % 8 == 3 else cluster["d"]
            victim.signal(signal.SIGSTOP)
            try:
                await asyncio.gather(*(ask(url, model, i, rng.choice([0.2, 0.5, 1.0]))
                                       for i in range(6)))
            finally:
                victim.signal(signal.SIGCONT)


def test_proxy_fds_return_to_warm_up_level_after_clients_leave_at_every_phase(
    cluster: dict[str, Proc],
) -> None:
    proxy = cluster["proxy"]
    model = str(httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"])
    asyncio.run(steady(proxy.url, model, 10))
    warm = fds(proxy)
    asyncio.run(storm(cluster, model))
    asyncio.run(steady(proxy.url, model, 10))
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=30)
    # The keep-alive pool drops idle connections after their expiry (its health checks
    # every 0.5 s keep the pool turning): wait for the level, bounded.
    deadline = time.monotonic() + 30
    while (fds(proxy) > warm + SLACK or close_wait(proxy)) and time.monotonic() < deadline:
        asyncio.run(steady(proxy.url, model, 1))
        time.sleep(0.5)
    assert fds(proxy) <= warm + SLACK, (warm, fds(proxy), os.listdir(
        f"/proc/{proxy.proc.pid if proxy.proc else 0}/fd"))
    assert close_wait(proxy) == 0, "the proxy holds sockets its peers closed"
