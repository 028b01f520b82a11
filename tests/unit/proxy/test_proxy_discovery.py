"""DNS discovery's parts (kvrelay.proxy.discovery): names and flags, the lookup
against a real DNS server (dnslib's, on a loopback UDP port), and how a role's engines
follow the answers. The whole proxy under load: tests/e2e/test_dns_discovery.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvrelay.cli import build_parser
from kvrelay.errors import UsageError
from kvrelay.proxy.affinity import RoutingConfig
from kvrelay.proxy.discovery import (
    Discovery,
    DnsName,
    DnsServer,
    LookupFailed,
    discovery_from,
    resolve,
)
from kvrelay.proxy.upstreams import Upstreams
from tests.e2e.dns_zone import Records, serve_zone
from tests.unit.server.fakes import free_port


@pytest.fixture
def dns() -> Iterator[tuple[Records, int]]:
    with serve_zone() as zone:
        yield zone


def test_names_parse_and_name_the_flag_when_they_do_not() -> None:
    assert DnsName.parse("--prefill-dns", "p.svc:8100") == DnsName("p.svc", 8100)
    assert DnsName("x", 80).url("10.0.0.7") == "http://10.0.0.7:80"
    assert DnsName("x", 80).url("fd00::7") == "http://[fd00::7]:80"
    for bad in ("p.svc", "p.svc:", ":8100", "p.svc:http", "p.svc:70000"):
        with pytest.raises(ValueError, match=r"--prefill-dns.*NAME:PORT"):
            DnsName.parse("--prefill-dns", bad)


def test_the_flags_need_urls_or_names_per_role() -> None:
    parse = build_parser().parse_args
    assert discovery_from(parse(["proxy", "--prefill", "http://p", "--decode", "http://d"])) \
        is None
    d = discovery_from(parse(["proxy", "--prefill", "http://p", "--decode-dns", "d.svc:81",
                              "--dns-server", "127.0.0.1:5353"]))
    assert d is not None and d.names == {"prefill": [], "decode": [DnsName("d.svc", 81)]}
    assert d.static == {"prefill": ["http://p"], "decode": []}
    with pytest.raises(UsageError, match=r"--decode URL\.\.\. or --decode-dns"):
        discovery_from(parse(["proxy", "--prefill-dns", "p.svc:80"]))
    with pytest.raises(UsageError, match="--dns-server"):
        discovery_from(parse(["proxy", "--prefill", "http://p", "--decode-dns", "d:1",
                              "--dns-server", "nowhere"]))


def test_lookup_against_a_real_dns_server(dns: tuple[Records, int]) -> None:
    records, port = dns
    records.set("p.kvrelay.test", ["127.0.0.3", "127.0.0.2"])
    records.set("empty.kvrelay.test", [])
    server = DnsServer("127.0.0.1", port)
    assert asyncio.run(server.lookup("p.kvrelay.test")) == ["127.0.0.2", "127.0.0.3"]
    assert asyncio.run(server.lookup("empty.kvrelay.test")) == []
    assert asyncio.run(server.lookup("nxdomain.kvrelay.test")) == []
    names = [DnsName("p.kvrelay.test", 8100), DnsName("empty.kvrelay.test", 1)]
    assert asyncio.run(resolve(names, server.lookup)) == [
        "http://127.0.0.2:8100", "http://127.0.0.3:8100"]


def test_no_answer_is_a_failed_lookup_not_an_empty_set() -> None:
    silent = DnsServer("127.0.0.1", free_port(), timeout=0.2)  # nobody listens there
    with pytest.raises(LookupFailed):
        asyncio.run(silent.lookup("p.kvrelay.test"))
    assert asyncio.run(resolve([DnsName("p.kvrelay.test", 1)], silent.lookup)) is None


def test_engines_follow_the_answers_and_a_failed_lookup_keeps_them() -> None:
    answers: dict[str, list[str] | None] = {"p.svc": ["10.0.0.1"]}

    async def lookup(name: str) -> list[str]:
        got = answers[name]
        if got is None:
            raise LookupFailed(name)
        return got

    now = [0.0]
    disc = Discovery({"prefill": [DnsName("p.svc", 8100)]}, lookup, interval=5.0,
                     static={"prefill": ["http://fixed:8100"]}, clock=lambda: now[0])
    ups = Upstreams("prefill", [], RoutingConfig(), discovered=True)
    assert ups.pick() is None  # nothing known yet: no engine, no crash

    def refresh() -> list[tuple[str, str]]:
        return asyncio.run(disc.refresh([ups]))

    assert refresh() == []
    assert [(u.url, u.healthy) for u in ups.all] == [
        ("http://10.0.0.1:8100", False), ("http://fixed:8100", False)]  # checked first
    first = ups.all[0]
    first.healthy = True
    answers["p.svc"] = ["10.0.0.2"]
    assert refresh() == []  # not due yet
    now[0] += 5.0
    assert refresh() == [("prefill", "http://10.0.0.1:8100")]
    assert [u.url for u in ups.all] == ["http://fixed:8100", "http://10.0.0.2:8100"]
    answers["p.svc"] = None  # the DNS server does not answer: nothing changes
    now[0] += 5.0
    assert refresh() == []
    assert [u.url for u in ups.all] == ["http://fixed:8100", "http://10.0.0.2:8100"]
    answers["p.svc"] = []  # the name has no address any more: only the fixed URL
    now[0] += 5.0
    assert refresh() == [("prefill", "http://10.0.0.2:8100")]
    assert [u.url for u in ups.all] == ["http://fixed:8100"]


def test_the_system_resolver_by_default() -> None:
    from kvrelay.proxy.discovery import system_lookup

    assert "127.0.0.1" in asyncio.run(system_lookup("localhost"))  # /etc/hosts
    d = discovery_from(build_parser().parse_args(
        ["proxy", "--prefill-dns", "localhost:8100", "--decode", "http://d"]))
    assert d is not None and d.lookup is system_lookup
