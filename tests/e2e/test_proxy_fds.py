"""The proxy's open fds come back to their warm-up level after clients leave at every phase.

Issue 21 item 7: the 30-minute soak saw the proxy's fds climb within each proxy life (15 ->
29 over 593 s) while its RSS stayed flat. Real processes: P, D and the proxy on the tiny
model; clients leave at every phase (before the proxy has P's connection, while P
prefills, while D streams: after the first chunk), some while P or D is stopped
(SIGSTOP), then steady load again. Once the load settles the proxy must hold no more
sockets than after warm-up (its keep-alive pool, bounded by the concurrency) and no socket
its peer has closed (CLOSE_WAIT: a connection nobody reads or closes any more) beyond
those it held then.

Without ``SweptTransport`` (kvrelay/proxy/app.py) this fails: httpcore strands a NEW
connection to D for each call cancelled between its connect and its first request
(seen: 10 fds at warm-up, 14 settled, 5 connections to D stuck NEW in the pool).

The second test is the CLOSE_WAIT the soak still saw after that: clients leaving just as
D's stream ends, which cancels the proxy's call inside its close of D's response.
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
from tests.e2e.cluster import Cluster, Proc, poll, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONCURRENCY = 3
SLACK = 2  # fds over the warm-up level allowed: a pooled connection or two in handover


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.testing.models import write_tiny_hf_model

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


async def ask(url: str, model: str, i: int, leave: float | str | None,
              max_tokens: int = 16) -> None:
    """One request; ``leave``: None (read it all), seconds after sending, or "chunk"
    (after the first streamed chunk)."""
    body = {"model": model, "prompt": f"prefix {i % 4} of the soak {i}",
            "max_tokens": max_tokens, "stream": leave == "chunk" or i % 2 == 0}
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


def test_proxy_closes_d_streams_whose_client_leaves_as_they_end(
    cluster: dict[str, Proc], tmp_path: Path,
) -> None:
    """P gone (the soak's kill_p; here a URL nothing listens on): every leg runs on D as
    colocated work, so a client's first chunk is D's, and one that leaves then leaves as
    D's short answer ends. The proxy's leg task is cancelled while it closes D's finished
    stream; httpcore's close stopped at its first await left the connection ACTIVE in the
    pool for ever, and CLOSE_WAIT once D timed it out (the soak: 1 -> 10 in 30 minutes).

    A race: without the fix about 2% of these clients strand a socket (seen: 16 of 900 on
    a 2-core machine), so 360 of them strand some with near certainty; with it, none."""
    gone = Proc("gone-prefill", [], tmp_path / "gone.log")  # never started
    c = Cluster(Path(), tmp_path)
    try:
        proxy = c.proxy([gone], [cluster["d"]]).wait_healthy()
        model = str(httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"])
        asyncio.run(steady(proxy.url, model, 3))
        # An idle connection D has just timed out sits in CLOSE_WAIT until the pool's
        # next request (the health check's, every 0.5 s) expires it: hence the polls.
        assert poll(lambda: close_wait(proxy) == 0, 15), "CLOSE_WAIT before any client left"
        rng = random.Random(21)

        async def leavers() -> None:
            for rnd in range(60):
                await asyncio.gather(*(ask(proxy.url, model, rnd * 6 + i, "chunk",
                                           max_tokens=rng.choice((2, 3, 4, 6, 8)))
                                       for i in range(6)))

        asyncio.run(leavers())
        pools_free(cluster["d"], timeout=30)
        quiet_sockets(proxy)  # D's keep-alive (5 s) has closed its side of each by then
        assert poll(lambda: close_wait(proxy) == 0, 15), (
            f"the proxy holds {close_wait(proxy):.0f} sockets D closed")
    finally:
        c.close()
        print(c.logs())
