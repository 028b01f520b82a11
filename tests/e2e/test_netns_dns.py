"""DNS discovery across "hosts": network namespaces on one bridge (tests/e2e/netns.py).

Host ``dns`` runs a DNS server (dnslib's, in this process: its UDP socket is bound on
10.213.7.x:53 inside that namespace and keeps it); hosts ``pa``, ``pb`` run a prefill
engine each and ``da``, ``db`` a decode engine each (tcp transport), all four on the same
ports, as pods behind a headless Service: the engines of a name differ by address only.
Host ``px`` runs two proxies with ``--prefill-dns``/``--decode-dns``: one asks the DNS
server itself (``--dns-server 10.213.7.x:53``), one uses the system resolver, which in a
namespace entered with ``ip netns exec NS`` reads ``/etc/netns/NS/resolv.conf`` (bind
mounted over ``/etc/resolv.conf``, as a pod's resolv.conf names the cluster DNS).

Under streamed load through the first proxy the records change: the ``b`` engines are
added (health-checked, then given work), then the ``a`` engines are removed (no new work,
what they had finishes). No request fails; every pool is whole at the end; the second
proxy follows the same changes.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import BLOCK_ARGS, Proc, metrics, pools_free, sample
from tests.e2e.dns_zone import Records, serve_zone
from tests.e2e.load import ENGINE_ARGS, Load, wait_for
from tests.e2e.netns import Net, NsProc, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

PREFILL, DECODE = "prefill.kvrelay.test", "decode.kvrelay.test"
P_PORT, D_PORT, RELAY_PORT = 8100, 8101, 8200
HOSTS = ["dns", "pa", "pb", "da", "db", "px"]


@contextlib.contextmanager
def resolv_conf(ns: str, nameserver: str) -> Iterator[None]:
    """``/etc/netns/NS/resolv.conf``: what ``ip netns exec NS`` shows its processes as
    ``/etc/resolv.conf``."""
    etc = Path("/etc/netns")
    made_etc = not etc.exists()
    d = etc / ns
    d.mkdir(parents=True, exist_ok=True)
    (d / "resolv.conf").write_text(f"nameserver {nameserver}\noptions timeout:1 attempts:2\n")
    try:
        yield
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if made_etc:
            with contextlib.suppress(OSError):
                etc.rmdir()


@pytest.fixture
def net() -> Iterator[Net]:
    why = unavailable()
    if why:
        pytest.skip(why)
    n = Net().build(HOSTS)
    try:
        yield n
    finally:
        n.close()
        print(n.logs())  # shown by pytest when the test failed


def engine(net: Net, host: str, model: Path, logdir: Path) -> NsProc:
    role, port = ("prefill", P_PORT) if host.startswith("p") else ("decode", D_PORT)
    args = ["serve", str(model), "--role", role, "--kv-transport", "tcp", *ENGINE_ARGS,
            *BLOCK_ARGS]
    if role == "prefill":
        args += ["--relay-host", net.hosts[host].address, "--relay-port", str(RELAY_PORT)]
    return net.proc(host, f"{role}-{host}", port, args, logdir)


def test_engines_that_join_and_leave_by_dns_across_namespaces_under_load(
        net: Net, tmp_path: Path) -> None:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path / "tiny-model"))
    dns_host = net.hosts["dns"].address
    addr = {h: net.hosts[h].address for h in HOSTS}
    with net.entered("dns"), serve_zone(dns_host, 53) as (records, _), \
            resolv_conf(net.hosts["px"].ns, dns_host):
        engines = {h: engine(net, h, model, tmp_path) for h in ("pa", "pb", "da", "db")}
        records.set(PREFILL, [addr["pa"]])
        records.set(DECODE, [addr["da"]])
        names = ["proxy", "--prefill-dns", f"{PREFILL}:{P_PORT}", "--decode-dns",
                 f"{DECODE}:{D_PORT}", "--dns-interval", "0.2", "--health-interval", "0.2"]
        proxy = net.proc("px", "proxy-dns-server", 8000,
                         [*names, "--dns-server", f"{dns_host}:53"], tmp_path)
        system = net.proc("px", "proxy-system-resolver", 8001, names, tmp_path)
        with net.entered("px"):  # this thread and the load's: on host px
            for p in (*engines.values(), proxy, system):
                p.wait_healthy(timeout=120)
            run_the_changes(records, addr, engines, proxy, system, model.name)


def run_the_changes(records: Records, addr: dict[str, str], engines: dict[str, NsProc],
                    proxy: Proc, system: Proc, model: str) -> None:
    first, second = (engines["pa"], engines["da"]), (engines["pb"], engines["db"])
    with Load(proxy.url, model) as load:
        load.wait_more(6)
        assert not took_work(*second)
        assert all(lists(px, e) for px in (proxy, system) for e in first)
        records.set(PREFILL, [addr["pa"], addr["pb"]])
        records.set(DECODE, [addr["da"], addr["db"]])
        wait_for("the added engines take work", lambda: took_work(*second))
        wait_for("the system resolver's proxy lists them",
                 lambda: all(lists(system, e) for e in second))
        records.set(PREFILL, [addr["pb"]])
        records.set(DECODE, [addr["db"]])
        wait_for("the proxies drop the removed engines",
                 lambda: not any(lists(px, e) for px in (proxy, system) for e in first))
        pools_free(first[1], prefill=(first[0],), timeout=30)  # what they had finished
        done = [finished(e) for e in first]
        load.wait_more(8)
        assert [finished(e) for e in first] == done, "a removed engine got new work"
    assert not load.failures, load.failures[:3]
    assert load.done >= 14
    log = proxy.tail(20000)
    assert f"prefill engine {second[0].url} appeared in DNS" in log
    assert f"decode engine {first[1].url} vanished from DNS" in log
    pools_free(*(e for e in engines.values() if e.name.startswith("decode")),
               prefill=tuple(e for e in engines.values() if e.name.startswith("prefill")),
               timeout=10)


def took_work(p: Proc, d: Proc) -> bool:
    return sample(metrics(p.url), "kvrelay_requests_finished_total",
                  reason="remote_decode") > 0 and \
        sample(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > 0


def finished(e: Proc) -> float:
    return sample(metrics(e.url), "kvrelay_requests_finished_total")


def lists(proxy: Proc, engine: Proc) -> bool:
    return any(f'url="{engine.url}"' in k for k in metrics(proxy.url)
               if k.startswith("kvrelay_proxy_engine_healthy"))
