"""The proxy's open fds come back to their warm-up level after clients leave at every phase.

Issue 21 item 7: the 30-minute soak saw the proxy's fds climb within each proxy life (15 ->
29 over 593 s) while its RSS stayed flat. Real processes: P, D and the proxy on the tiny
model; clients leave at every phase (before the proxy has P's connection, while P
prefills, while D streams: after the first chunk), some while P or D is stopped
(SIGSTOP), then steady load again. Once the load settles the proxy must hold no more
sockets than after warm-up (its keep-alive pool, bounded by the concurrency) and no socket
its peer has closed (CLOSE_WAIT: a connection nobody reads or closes any more) beyond
those it held then.

Without ``SweptTransport`` (kvrelay/server/proxy.py) this fails: httpcore strands a NEW
connection to D for each call cancelled between its connect and its first request
(seen: 10 fds at warm-up, 14 settled, 5 connections to D stuck NEW in the pool).
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
        yield c.pd()
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
        elif leave == "chunk":  # leave on P's first token, as the proxy calls D
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and "choices" in line:
                        break
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
    for rnd in range(50):  # the soak's leaver: gone after the first chunk (P's token)
        await asyncio.gather(*(ask(url, model, rnd * CONCURRENCY + i, "chunk")
                               for i in range(CONCURRENCY)))
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


def quiet_sockets(p: Proc) -> float:
    """The proxy's established sockets once no request is in flight: its keep-alive pool
    closes idle connections after their expiry (5 s), so only the health checks' stay (one
    per engine, used every 0.5 s) and any connection nothing will ever use or close.
    Polled until it stops falling (bounded), never slept on blindly."""
    assert p.proc is not None
    deadline, last, since = time.monotonic() + 40, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = tcp_states(p.proc.pid).get("tcp_established", 0.0)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 12:  # unchanged past the expiry: settled
            break
        time.sleep(0.25)
    return last


def test_proxy_fds_return_to_warm_up_level_after_clients_leave_at_every_phase(
    cluster: dict[str, Proc],
) -> None:
    proxy = cluster["proxy"]
    model = str(httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"])
    asyncio.run(steady(proxy.url, model, 10))
    warm, warm_cw = quiet_sockets(proxy), close_wait(proxy)
    warm_fds = fds(proxy)
    asyncio.run(storm(cluster, model))
    asyncio.run(steady(proxy.url, model, 10))
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=30)
    settled = quiet_sockets(proxy)
    assert settled <= warm, f"established sockets {warm:.0f} at warm-up, {settled:.0f} now"
    assert close_wait(proxy) <= warm_cw, "the proxy holds more sockets its peers closed"
    assert fds(proxy) <= warm_fds + SLACK, (warm_fds, fds(proxy))
