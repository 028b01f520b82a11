"""DNS discovery: ``kvrelay proxy --prefill-dns NAME:PORT --decode-dns NAME:PORT``.

A real DNS server (dnslib's, in this process, on a loopback UDP port) answers for two
names, one per role, as a Kubernetes headless Service would: one A record per engine.
The proxy reaches it through ``--dns-server 127.0.0.1:PORT`` (its own UDP queries;
without the flag it asks the system resolver). The engines of a name share its port and
differ by address: 127.0.0.1 and 127.0.0.2 (Linux routes all of 127.0.0.0/8 to the
loopback). Under streamed load the records change: the second pair of engines is added
(the proxy health-checks them, then they take work), then the first pair is removed (no
new work reaches them, what they had finishes). No client request fails; every pool is
whole at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.demo import free_port
from tests.e2e.cluster import Cluster, Proc, metrics, pools_free, sample
from tests.e2e.dns_zone import Records, serve_zone
from tests.e2e.load import ENGINE_ARGS, Load, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

PREFILL, DECODE = "prefill.kvrelay.test", "decode.kvrelay.test"


@pytest.fixture
def dns() -> Iterator[tuple[Records, int]]:
    with serve_zone() as zone:
        yield zone


def test_engines_that_join_and_leave_by_dns_under_streamed_load(
    tmp_path: Path, dns: tuple[Records, int]
) -> None:
    from kvrelay.testing.models import write_tiny_hf_model

    records, dns_port = dns
    model = Path(write_tiny_hf_model(tmp_path / "tiny-model"))
    c = Cluster(model, tmp_path)
    pp, dp = free_port(), free_port()
    try:
        first = [c.prefill("prefill-1", *ENGINE_ARGS, host="127.0.0.1", port=pp),
                 c.decode("decode-1", "shm", *ENGINE_ARGS, host="127.0.0.1", port=dp)]
        second = [c.prefill("prefill-2", *ENGINE_ARGS, host="127.0.0.2", port=pp),
                  c.decode("decode-2", "tcp", *ENGINE_ARGS, host="127.0.0.2", port=dp)]
        for e in (*first, *second):
            e.wait_healthy()
        records.set(PREFILL, ["127.0.0.1"])
        records.set(DECODE, ["127.0.0.1"])
        proxy = c._proc("proxy-dns", [
            "proxy", "--prefill-dns", f"{PREFILL}:{pp}", "--decode-dns", f"{DECODE}:{dp}",
            "--dns-server", f"127.0.0.1:{dns_port}", "--dns-interval", "0.2",
            "--health-interval", "0.2"]).start().wait_healthy()
        with Load(proxy.url, model.name) as load:
            load.wait_more(6)
            assert not took_work(*second)
            records.set(PREFILL, ["127.0.0.1", "127.0.0.2"])
            records.set(DECODE, ["127.0.0.1", "127.0.0.2"])
            wait_for("the added engines take work", lambda: took_work(*second))
            records.set(PREFILL, ["127.0.0.2"])
            records.set(DECODE, ["127.0.0.2"])
            wait_for("the proxy drops the removed engines",
                     lambda: not any(proxy_lists(proxy, e) for e in first))
            pools_free(first[1], prefill=(first[0],), timeout=30)  # what they had finished
            done = [finished(e) for e in first]
            load.wait_more(8)
            assert [finished(e) for e in first] == done, "a removed engine got new work"
        assert not load.failures, load.failures[:3]
        assert f"prefill engine {second[0].url} appeared in DNS" in proxy.tail(20000)
        assert f"decode engine {first[1].url} vanished from DNS" in proxy.tail(20000)
        pools_free(first[1], second[1], prefill=(first[0], second[0]), timeout=10)
    finally:
        c.close()
        print(c.logs())


def took_work(p: Proc, d: Proc) -> bool:
    return sample(metrics(p.url), "kvrelay_requests_finished_total",
                  reason="remote_decode") > 0 and \
        sample(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > 0


def finished(e: Proc) -> float:
    return sample(metrics(e.url), "kvrelay_requests_finished_total")


def proxy_lists(proxy: Proc, engine: Proc) -> bool:
    return any(f'url="{engine.url}"' in k for k in metrics(proxy.url)
               if k.startswith("kvrelay_proxy_engine_healthy"))
