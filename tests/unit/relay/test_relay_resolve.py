"""D's relay host names, resolved off the event loop with a bounded cache
(kvrelay.relay.resolve)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from kvrelay.relay.resolve import RelayResolver


class Dns:
    """A stand-in getaddrinfo: answers from a table, counts lookups, may hang."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table, self.calls = table, 0
        self.release = threading.Event()
        self.hang: set[str] = set()

    def __call__(self, host: str, port: int, family: int, type: int) -> list[tuple[Any, ...]]:
        self.calls += 1
        if host in self.hang:
            self.release.wait(10)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, port))
                for a in self.table[host]]


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_names_resolve_to_one_address_and_are_cached() -> None:
    dns, clock = Dns({"localhost": ["::1", "127.0.0.1"], "p0": ["10.0.0.5"]}), Clock()
    r = RelayResolver(getaddrinfo=dns, clock=clock, ttl=30)

    async def go() -> list[str]:
        return [await r.resolve(x) for x in ("localhost:5000", "localhost:5001",
                                             "127.0.0.1:5000", "p0:7000")]

    assert asyncio.run(go()) == ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5000",
                                 "10.0.0.5:7000"]
    assert dns.calls == 2  # localhost once (cached for the second port), p0 once; no IP
    clock.t = 31.0
    asyncio.run(r.resolve("localhost:5000"))
    assert dns.calls == 3  # aged out: asked again
    r.close()


def test_a_name_that_does_not_resolve_or_hangs_is_a_value_error_and_is_cached() -> None:
    dns = Dns({})
    dns.hang.add("slow")
    r = RelayResolver(getaddrinfo=dns, timeout=0.2)
    with pytest.raises(ValueError, match="the relay host 'nope' does not resolve: gaierror"):
        asyncio.run(r.resolve("nope:5000"))
    with pytest.raises(ValueError, match=r"'slow' does not resolve: no answer within 0\.2 s"):
        asyncio.run(r.resolve("slow:5000"))
    dns.release.set()
    calls = dns.calls
    with pytest.raises(ValueError, match="does not resolve"):
        asyncio.run(r.resolve("nope:5000"))
    assert dns.calls == calls  # the failure is cached too
    r.close()


def test_the_cache_is_bounded() -> None:
    dns = Dns({f"h{i}": [f"10.0.0.{i}"] for i in range(10)})
    r = RelayResolver(getaddrinfo=dns, cap=3)

    async def go() -> None:
        for i in range(10):
            await r.resolve(f"h{i}:1")

    asyncio.run(go())
    assert len(r._cache) == 3
    r.close()
