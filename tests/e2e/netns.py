"""Several "hosts" on one machine: network namespaces joined to a bridge.

``Net`` builds, for a test module, one namespace per host plus a switch namespace that
holds the bridge (nothing is added to the root namespace, no address leaves these
namespaces: there is no uplink). A host is linked to the bridge either by a veth pair
or by a ``Wire``: two TAP devices and a userspace forwarder between them that can add
latency, drop frames at random or partition the link (these kernels have no netem).
Addresses come from TEST_NET, a private range used only inside these namespaces.

Processes are started in a host with ``ip netns exec``; the test thread itself reaches
them by entering a namespace with setns(2) (``Net.entered``): a network namespace is a
per-thread attribute, and a socket keeps the namespace it was created in.

Everything is torn down in ``Net.close``: processes killed, forwarders stopped, TAP
devices closed, namespaces deleted (their veths go with them).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import random
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.netns import entered
from tests.e2e.cluster import Proc, env

TEST_NET = "10.213.7"  # /24 inside our own namespaces only
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def unavailable() -> str | None:
    """Why namespaces cannot be built here (the tests skip with it), or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (the latency/drop wire needs TAP devices)"
    name = f"kvrt-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def open_tap(ns: str, name: str) -> int:
    """A TAP device ``name`` in namespace ``ns``; it lives as long as the fd."""
    with entered(ns):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


class Wire(threading.Thread):
    """A link made of two TAP fds and this thread between them: every frame is held
    ``delay`` seconds, dropped with probability ``drop``, or all dropped while
    ``partitioned``. Settings may change while it runs."""

    def __init__(self, a: int, b: int, seed: int = 0) -> None:
        super().__init__(daemon=True, name="netns-wire")
        self.fds = (a, b)
        self.delay = 0.0
        self.drop = 0.0
        self.partitioned = False
        self.frames = self.dropped = 0
        self._rng = random.Random(seed)
        self._queues: tuple[collections.deque[tuple[float, bytes]], ...] = (
            collections.deque(), collections.deque())
        self._stop_r, self._stop_w = os.pipe()

    def set(self, *, delay: float = 0.0, drop: float = 0.0, partitioned: bool = False) -> None:
        self.delay, self.drop, self.partitioned = delay, drop, partitioned

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.fds[0], selectors.EVENT_READ, 0)  # a -> b
        sel.register(self.fds[1], selectors.EVENT_READ, 1)  # b -> a
        sel.register(self._stop_r, selectors.EVENT_READ, None)
        while True:
            heads = [q[0][0] for q in self._queues if q]
            timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
            for key, _ in sel.select(timeout):
                if key.data is None:
                    sel.close()
                    return
                self._take(key.data)
            now = time.monotonic()
            for d, q in enumerate(self._queues):
                while q and q[0][0] <= now:
                    frame = q.popleft()[1]
                    with contextlib.suppress(OSError):  # a device going away
                        os.write(self.fds[1 - d], frame)

    def _take(self, d: int) -> None:
        while True:
            try:
                frame = os.read(self.fds[d], 65536)
            except (BlockingIOError, OSError):
                return
            self.frames += 1
            if self.partitioned or (self.drop and self._rng.random() < self.drop):
                self.dropped += 1
                continue
            self._queues[d].append((time.monotonic() + self.delay, frame))

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        self.join(5)
        for fd in (*self.fds, self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Host:
    name: str  # short name: "p", "d", "px"
    ns: str
    address: str
    wire: Wire | None = None


@dataclass
class NsProc(Proc):
    """A kvrelay process inside a host namespace, on the host's address."""

    host: Host | None = None

    @property
    def url(self) -> str:
        assert self.host is not None
        return f"http://{self.host.address}:{self.port}"

    def start(self) -> NsProc:
        assert self.host is not None
        cmd = ["ip", "netns", "exec", self.host.ns, sys.executable, "-m", "kvrelay",
               *self.args, "--host", self.host.address, "--port", str(self.port),
               "--log-level", "info"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env(self.extra_env), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self


@dataclass
class Net:
    """Hosts in namespaces on one bridge. ``wired`` hosts get a ``Wire`` link."""

    hosts: dict[str, Host] = field(default_factory=dict)
    prefix: str = field(default_factory=lambda: f"kvrt{os.getpid()}")
    procs: list[NsProc] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ip(self, ns: str, *args: str) -> None:
        r = subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ip -n {ns} {' '.join(args)}: {r.stderr.strip()}")

    def build(self, names: list[str], wired: tuple[str, ...] = ()) -> Net:
        subprocess.run(["ip", "netns", "add", self.switch], check=True)
        self.ip(self.switch, "link", "add", "br0", "type", "bridge")
        self.ip(self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            h = Host(name, f"{self.prefix}-{name}", f"{TEST_NET}.{10 + i}")
            self.hosts[name] = h
            subprocess.run(["ip", "netns", "add", h.ns], check=True)
            self.ip(h.ns, "link", "set", "lo", "up")
            port = f"s-{name}"
            if name in wired:
                h.wire = Wire(open_tap(h.ns, "eth0"), open_tap(self.switch, port), seed=i)
                h.wire.start()
            else:
                self.ip(self.switch, "link", "add", port, "type", "veth", "peer", "name",
                        "eth0", "netns", h.ns)
            self.ip(self.switch, "link", "set", port, "master", "br0", "up")
            self.ip(h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            self.ip(h.ns, "link", "set", "eth0", "up")
        return self

    def entered(self, host: str) -> contextlib.AbstractContextManager[None]:
        return entered(self.hosts[host].ns)

    def proc(self, host: str, name: str, port: int, args: list[str], logdir: Path,
             extra_env: dict[str, str] | None = None) -> NsProc:
        p = NsProc(name, args, logdir / f"{name}.log", port=port,
                   extra_env=extra_env or {}, host=self.hosts[host])
        self.procs.append(p)
        return p.start()

    def close(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.kill()
        for h in self.hosts.values():
            # Anything still running in our namespaces was started by these tests.
            r = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if h.wire is not None:
                h.wire.stop()
        for ns in [*(h.ns for h in self.hosts.values()), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.hosts.clear()

    def logs(self) -> str:
        return "\n".join(f"==== {p.name} ====\n{p.tail()}" for p in self.procs)
