"""Graceful drain on 2P2D: SIGTERM to a prefill and a decode engine under streamed load.

Real processes (tests/e2e/cluster.py) on the tiny model, a small streamed load through the
proxy with the official openai client (no retries: a failure is a failure). SIGTERM one P
and one D at once: both finish what they have, P serves its relay until every lease has
ended, both exit 0, the load goes on without a failed request; then both are started
again on the same URLs, the proxy finds them healthy and sends them work again, and at the
end every pool is whole. A second test holds a decode engine in its drain and shows the
proxy handing a leg the engine refused (503 draining) to the other decode engine, before
its health check has noticed. A third shows a draining P up for as long as it holds a
lease, its relay serving a pull and its /v1/kv/release a give-back.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, metrics, pools_free, sample
from tests.e2e.load import ENGINE_ARGS, MAX_TOKENS, Load, ask_streamed, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("drain-logs"))
    try:
        ps = [c.prefill("prefill-a", *ENGINE_ARGS), c.prefill("prefill-b", *ENGINE_ARGS)]
        ds = [c.decode("decode-shm", "shm", *ENGINE_ARGS),
              c.decode("decode-tcp", "tcp", *ENGINE_ARGS)]
        for x in (*ps, *ds):
            x.wait_healthy()
        yield {"p": ps, "d": ds, "model": model, "cluster": c}
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def proxy_sees(proxy: Proc, engine: Proc, healthy: bool) -> bool:
    m = metrics(proxy.url)
    return sample(m, "kvrelay_proxy_engine_healthy", url=engine.url) == (1 if healthy else 0)


LEASES = re.compile(r"stopped; KV blocks: (\d+) of (\d+) free or cached; leases: (\d+) "
                    r"created, (\d+) released \(([^)]*)\), (\d+) still held")
BLOCKS = re.compile(r"stopped; KV blocks: (\d+) of (\d+) free or cached")


def test_drain_one_p_and_one_d_under_streamed_load_then_add_them_back(
    cluster: dict[str, Any]
) -> None:
    c: Cluster = cluster["cluster"]
    ps, ds = cluster["p"], cluster["d"]
    proxy = c.proxy(ps, ds).wait_healthy()
    p, d = ps[0], ds[0]
    with Load(proxy.url, cluster["model"].name) as load:
        load.wait_more(8)
        for e in (p, d):
            e.signal(signal.SIGTERM)
        for e in (p, d):
            assert e.proc is not None
            assert e.proc.wait(40) == 0, e.tail()  # within --shutdown-timeout (10 s) + 5
        load.wait_more(4)  # served by the other two meanwhile
        p_log, d_log = p.tail(20000), d.tail(20000)
        assert "drained in" in p_log and "drained in" in d_log, (p_log, d_log)
        # Every lease P made ended before it exited, none by running out of time, and
        # both pools were whole at the exit.
        m = LEASES.search(p_log)
        assert m, p_log
        free, total, created, released, reasons, held = m.groups()
        assert free == total and int(created) > 0 and created == released and held == "0", \
            m.group(0)
        assert "expired" not in reasons, m.group(0)  # each pulled, or given back
        assert "grace period" not in p_log and "grace period" not in d_log
        b = BLOCKS.search(d_log)
        assert b and b.group(1) == b.group(2), d_log

        p2, d2 = c.restart(p), c.restart(d)
        wait_for("the proxy sees the restarted engines healthy",
                 lambda: proxy_sees(proxy, p2, True) and proxy_sees(proxy, d2, True))
        wait_for("the restarted engines take work again", lambda: sample(
            metrics(p2.url), "kvrelay_requests_finished_total", reason="remote_decode") > 0
            and sample(metrics(d2.url), "kvrelay_kv_transfer_bytes_total") > 0)
        load.wait_more(4)
    assert not load.failures, load.failures[:3]
    ps[0], ds[0] = p2, d2
    pools_free(*ds, prefill=tuple(ps), timeout=10)


def test_a_draining_decode_engine_hands_new_legs_to_the_other(cluster: dict[str, Any]) -> None:
    """Proxies that check health only once (at start) still take the draining engine for
    healthy and route to it first (least outstanding, a tie: the first listed): it refuses
    (503 draining; or the connection, if it is gone already) and the proxy sends the leg to
    the other decode engine, a whole answer
    through one proxy and a stream through the other. Without the hand-over both clients
    get the 503."""
    c: Cluster = cluster["cluster"]
    ps, ds = cluster["p"], cluster["d"]
    d, other = ds
    proxies = [checked_once(c, f"proxy-once-{i}", ps, ds) for i in range(2)]
    model = cluster["model"].name
    # A long stream straight to d keeps it draining (no proxy counts it).
    body = {"model": model, "prompt": "hold", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    first = threading.Event()
    lines: list[str] = []

    def hold() -> None:
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    t = threading.Thread(target=hold)
    t.start()
    assert first.wait(60), "the holding stream never started"
    before = sample(metrics(other.url), "kvrelay_requests_finished_total", reason="length")
    d.signal(signal.SIGTERM)
    # d's log, not its /health: the hand-over holds also if d is gone already (a
    # crushed machine, the long stream done), its refused connection handed over.
    wait_for("d drains", lambda: "draining for at most" in d.tail())
    whole = openai.OpenAI(base_url=proxies[0].url + "/v1", api_key="none", max_retries=0,
                          timeout=60)
    r = whole.completions.create(prompt="whole answer", model=model, max_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == MAX_TOKENS
    assert asyncio.run(_ask_once(proxies[1].url, model)) == (MAX_TOKENS, "length")
    after = sample(metrics(other.url), "kvrelay_requests_finished_total", reason="length")
    assert after - before == 2
    for proxy in proxies:
        assert f"decode engine {d.url} refused a leg unseen" in proxy.tail(), proxy.tail()
        assert proxy_sees(proxy, d, True)  # its health check never ran again
    assert d.proc is not None and d.proc.wait(60) == 0
    t.join(10)
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    ds[0] = c.restart(d)
    pools_free(*ds, prefill=tuple(ps), timeout=10)


def checked_once(c: Cluster, name: str, ps: list[Proc], ds: list[Proc]) -> Proc:
    """A proxy whose one health check (at start) found every engine healthy. That check
    has a 2 s timeout: on a machine too busy for it, start the proxy again."""
    for _ in range(3):
        proxy = c._proc(name, [
            "proxy", "--prefill", *[x.url for x in ps], "--decode", *[x.url for x in ds],
            "--health-interval", "3600", "--routing", "least-outstanding"]).start()
        proxy.wait_healthy()
        wait_for("the proxy's first health check", lambda x=proxy: all(
            any(f'url="{e.url}"' in k for k in metrics(x.url)
                if k.startswith("kvrelay_proxy_engine_healthy")) for e in (*ps, *ds)))
        if all(proxy_sees(proxy, e, True) for e in (*ps, *ds)):
            return proxy
        proxy.kill()
    raise AssertionError(f"{name}: no health check found every engine healthy")


async def _ask_once(url: str, model: str) -> tuple[int, str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=60)
    try:
        return await ask_streamed(client, model, "a streamed answer", chat=True)
    finally:
        await client.close()


def test_a_draining_prefill_engine_serves_its_relay_until_its_leases_end(
    cluster: dict[str, Any]
) -> None:
    """Two leases on a P of its own (none expires: ENGINE_ARGS' 30 s), then
    SIGTERM: P says draining, but it stays up while a lease is held. A decode engine
    pulls the first from the draining P; P is still up for the second; the proxy's
    release of the second (``/v1/kv/release``, served while draining) lets it exit 0,
    its ledger: two created, one done, one aborted."""
    c: Cluster = cluster["cluster"]
    d = cluster["d"][1]
    p = c.prefill("prefill-leases", *ENGINE_ARGS).wait_healthy()
    model = cluster["model"].name
    base = {"model": model, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    leases = []
    for prompt in ("first lease", "second lease"):
        r = httpx.post(p.url + "/v1/completions", timeout=60, json={
            **base, "prompt": prompt, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        leases.append((prompt, r.json()["kv_transfer_params"]))
    p.signal(signal.SIGTERM)
    wait_for("p says draining", lambda: httpx.get(p.url + "/health").status_code == 503)
    wait_for("p waits for its leases", lambda: "waiting for 2 leases held" in p.tail())
    (prompt, first), (_, second) = leases
    pulled = sample(metrics(d.url), "kvrelay_kv_transfer_bytes_total")
    r = httpx.post(d.url + "/v1/completions", timeout=60, json={
        **base, "prompt": prompt, "kv_transfer_params": {**first, "first_token_sent": True}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert sample(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > pulled
    assert p.alive(), "p exited with a lease still held"
    answer = httpx.post(p.url + "/v1/kv/release", timeout=30,
                        json={"kv_transfer_params": second})
    assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text
    assert p.proc is not None and p.proc.wait(30) == 0
    ledger = LEASES.search(p.tail())
    assert ledger and ledger.group(0).endswith(
        "leases: 2 created, 2 released (aborted 1, done 1), 0 still held"), p.tail()
