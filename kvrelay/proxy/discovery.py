"""Engines found by DNS: ``kvrelay proxy --prefill-dns NAME:PORT --decode-dns NAME:PORT``.

A name stands for a set of engines, as a Kubernetes headless Service gives them: every
A and AAAA record is one engine, ``http://ADDRESS:PORT``. The proxy re-resolves each
name every ``--dns-interval`` seconds (kvrelay.proxy.health, ``watch_health``):
an address that appears becomes an engine, health-checked before it gets work; one that
vanishes gets no new requests, and the requests it has finish (they hold their engine).
A lookup that fails (timeout, server failure) changes nothing: a DNS hiccup must not
empty the proxy; an answer without records (or NXDOMAIN) is an empty set.

The system resolver (``getaddrinfo``: the pod's resolv.conf, search domains and all)
by default; with ``--dns-server HOST:PORT`` the proxy asks that server itself, over
UDP (dnslib builds and parses the messages): a test's server on a loopback port, or a
cluster DNS named explicitly.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

Lookup = Callable[[str], Awaitable[list[str]]]


class LookupFailed(Exception):
    """No answer (timeout, refused, SERVFAIL): keep what the name had."""


@dataclass(frozen=True)
class DnsName:
    name: str
    port: int

    @classmethod
    def parse(cls, flag: str, text: str) -> DnsName:
        name, sep, port = text.rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{flag} {text!r}: expected NAME:PORT, e.g. "
                             "kvrelay-prefill.default.svc.cluster.local:8100")
        return cls(name, int(port))

    def url(self, address: str) -> str:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"http://{host}:{self.port}"


async def system_lookup(name: str) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
            return []  # the name has no address (now): no engines
        raise LookupFailed(f"{name}: {exc}") from exc
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class DnsServer:
    """Asks one DNS server directly for A and AAAA records."""

    host: str
    port: int
    timeout: float = 2.0

    async def lookup(self, name: str) -> list[str]:
        return await asyncio.to_thread(self._lookup, name)

    def _lookup(self, name: str) -> list[str]:
        from dnslib import QTYPE, RCODE, DNSRecord

        found: set[str] = set()
        for qtype in ("A", "AAAA"):
            try:
                raw = DNSRecord.question(name, qtype).send(self.host, self.port,
                                                           timeout=self.timeout)
                reply = DNSRecord.parse(raw)
            except Exception as exc:  # socket errors, a malformed reply: no answer
                raise LookupFailed(f"{name} {qtype} at {self.host}:{self.port}: "
                                   f"{type(exc).__name__}: {exc}") from exc
            if reply.header.rcode not in (RCODE.NOERROR, RCODE.NXDOMAIN):
                raise LookupFailed(f"{name} {qtype}: {RCODE.get(reply.header.rcode)}")
            want = getattr(QTYPE, qtype)
            found.update(str(rr.rdata) for rr in reply.rr if rr.rtype == want)
        return sorted(found)


async def resolve(names: list[DnsName], lookup: Lookup) -> list[str] | None:
    """The engine URLs of ``names`` (sorted), or None when a lookup failed."""
    urls: set[str] = set()
    for d in names:
        try:
            urls.update(d.url(a) for a in await lookup(d.name))
        except LookupFailed:
            return None
    return sorted(urls)


class Members(Protocol):
    """What discovery changes: one role's engines (proxy_routing.Upstreams)."""

    role: str

    def update(self, urls: list[str]) -> tuple[list[str], list[str]]: ...


@dataclass
class Discovery:
    """The DNS names of each role, re-resolved at most every ``interval`` seconds."""

    names: dict[str, list[DnsName]]  # role -> names
    lookup: Lookup = system_lookup
    interval: float = 5.0
    static: dict[str, list[str]] = field(default_factory=dict)  # role -> --prefill/--decode
    clock: Callable[[], float] = time.monotonic
    _due: float = float("-inf")

    async def refresh(self, members: list[Members]) -> list[tuple[str, str]]:
        """Re-resolve when due and update ``members``; (role, URL) of those that
        vanished."""
        if self.clock() < self._due:
            return []
        self._due = self.clock() + self.interval
        gone: list[tuple[str, str]] = []
        for m in members:
            names = self.names.get(m.role)
            if not names:
                continue
            try:
                urls = await resolve(names, self.lookup)
            except Exception:  # a bug or an odd name must not stop the health loop
                log.exception("DNS lookup of the %s engines raised", m.role)
                urls = None
            if urls is None:
                log.warning("DNS lookup of the %s engines failed: keeping the ones known",
                            m.role)
                continue
            added, removed = m.update(sorted({*self.static.get(m.role, []), *urls}))
            for url in added:
                log.info("%s engine %s appeared in DNS: health-checked, then used", m.role,
                         url)
            for url in removed:
                log.info("%s engine %s vanished from DNS: no new requests", m.role, url)
            gone.extend((m.role, url) for url in removed)
        return gone


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-dns", nargs="+", default=[], metavar="NAME:PORT",
                   help="DNS names whose every A/AAAA record is a prefill engine on PORT "
                   "(e.g. a Kubernetes headless Service), re-resolved every --dns-interval")
    p.add_argument("--decode-dns", nargs="+", default=[], metavar="NAME:PORT",
                   help="DNS names whose every A/AAAA record is a decode engine on PORT")
    p.add_argument("--dns-interval", type=float, default=5.0, metavar="SECONDS",
                   help="how often the DNS names are resolved again (at most as often as "
                   "--health-interval)")
    p.add_argument("--dns-server", default=None, metavar="HOST:PORT",
                   help="ask this DNS server directly (UDP) instead of the system resolver")


def discovery_from(args: argparse.Namespace) -> Discovery | None:
    """The proxy's Discovery from its flags (None without DNS names); UsageError for a
    role with neither URLs nor names, or a malformed NAME:PORT."""
    from kvrelay.errors import UsageError

    try:
        names = {"prefill": [DnsName.parse("--prefill-dns", t) for t in args.prefill_dns],
                 "decode": [DnsName.parse("--decode-dns", t) for t in args.decode_dns]}
        server = DnsName.parse("--dns-server", args.dns_server) if args.dns_server else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for role in ("prefill", "decode"):
        if not getattr(args, role) and not names[role]:
            raise UsageError(f"give the {role} engines: --{role} URL... or "
                             f"--{role}-dns NAME:PORT...")
    if args.dns_interval <= 0:
        raise UsageError(f"--dns-interval must be > 0, got {args.dns_interval}")
    if not names["prefill"] and not names["decode"]:
        return None
    if server is not None:
        try:
            import dnslib  # noqa: F401
        except ImportError as exc:
            raise UsageError("--dns-server needs dnslib: pip install 'kvrelay[dns]' (or "
                             "leave the flag out to use the system resolver)") from exc
    lookup = DnsServer(server.name, server.port).lookup if server else system_lookup
    return Discovery(names, lookup, args.dns_interval,
                     static={"prefill": args.prefill, "decode": args.decode})
