"""A DNS zone the tests edit, served by dnslib's DNS server on a UDP port (loopback by
default)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from kvrelay.demo import free_port


class Records:
    """name -> A records (dnslib's resolver interface); NXDOMAIN for unknown names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._a: dict[str, list[str]] = {}

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self._a[name] = list(addresses)

    def resolve(self, request: Any, handler: Any) -> Any:
        from dnslib import QTYPE, RCODE, RR, A

        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self._lock:
            addresses = self._a.get(name)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for a in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(a), ttl=0))
        return reply


@contextlib.contextmanager
def serve_zone(address: str = "127.0.0.1",
               port: int | None = None) -> Iterator[tuple[Records, int]]:
    """(the zone, its UDP port on ``address``: a free one by default) while the server
    runs. The socket is bound here, in this thread's network namespace, and keeps it."""
    from dnslib.server import DNSLogger, DNSServer

    records, port = Records(), port or free_port()
    server = DNSServer(records, port=port, address=address,
                       logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send"))
    server.start_thread()
    try:
        yield records, port
    finally:
        server.stop()
