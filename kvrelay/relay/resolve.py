"""D: a relay named by a host name is keyed by the address it resolves to.

``canonical_relay`` gives one spelling per name, but ``localhost:5000`` and
``127.0.0.1:5000`` (or two names of one host) are still two relays to the client: two
connections, two sender threads, two pools of data sockets and two of P's per-address
slots. The decode engine's HTTP handler resolves the host at admission, so every
spelling of one relay is one key. Resolution never blocks the event loop: it runs on
a small executor of its own (a flood of names that never resolve cannot take the
threads ``asyncio.to_thread`` serves other work with), each lookup waits ``timeout``
at most, and answers (failures too) are cached, at most ``cap`` of them for ``ttl``
seconds: nothing a client writes sizes a resource. A name that does not resolve is
the client's error (ValueError, an HTTP 400 naming ``kv_transfer_params``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrelay.relay.remote import canonical_relay

GetAddrInfo = Callable[..., list[tuple[Any, ...]]]


class RelayResolver:
    def __init__(self, *, timeout: float = 2.0, ttl: float = 30.0, cap: int = 256,
                 workers: int = 4, clock: Callable[[], float] = time.monotonic,
                 getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> None:
        self.timeout, self.ttl, self.cap, self.clock = timeout, ttl, cap, clock
        self._getaddrinfo = getaddrinfo
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvrelay-resolve")
        # host -> (when, address or None, the error when None)
        self._cache: OrderedDict[str, tuple[float, str | None, str]] = OrderedDict()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def resolve(self, relay: str) -> str:
        """``relay`` (canonical host:port) with its host replaced by the address it
        resolves to; as is when the host is an address already."""
        host, _, port = relay.rpartition(":")
        try:
            ipaddress.ip_address(host)
            return relay
        except ValueError:
            pass
        address, error = self._cached(host)
        if address is None and not error:
            address, error = await self._lookup(host, port)
            self._remember(host, address, error)
        if address is None:
            raise ValueError(f"the relay host {host!r} does not resolve: {error}")
        return canonical_relay(f"{address}:{port}")

    def _cached(self, host: str) -> tuple[str | None, str]:
        entry = self._cache.get(host)
        if entry is None or entry[0] <= self.clock() - self.ttl:
            return None, ""
        return entry[1], entry[2]

    def _remember(self, host: str, address: str | None, error: str) -> None:
        self._cache.pop(host, None)
        self._cache[host] = (self.clock(), address, error)
        while len(self._cache) > self.cap:
            self._cache.popitem(last=False)

    async def _lookup(self, host: str, port: str) -> tuple[str | None, str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.run_in_executor(
                self._executor, lambda: self._getaddrinfo(host, int(port), 0,
                                                          socket.SOCK_STREAM)), self.timeout)
        except TimeoutError:
            return None, f"no answer within {self.timeout:g} s"
        except (OSError, UnicodeError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        # IPv4 first: the address P advertises for itself is usually one.
        addrs = sorted((info[4][0] for info in infos), key=lambda a: ":" in a)
        return (addrs[0], "") if addrs else (None, "no address")
