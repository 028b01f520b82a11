"""Two network namespaces joined by a veth pair, for benchmarks across a network boundary
on one machine (root only). A thread enters a namespace with setns(2): the namespace
is a per-thread attribute, a socket keeps the one it was created in, and a thread
started inside inherits it. The addresses (TEST_NET) exist only inside the pair.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
TEST_NET = "10.213.8"  # /24, inside these namespaces only

_libc = ctypes.CDLL(None, use_errno=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    return None


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run this thread inside network namespace ``ns`` (by ``ip netns`` name)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@contextlib.contextmanager
def veth_pair(prefix: str | None = None) -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Namespaces A and B joined by one veth pair: yields ((ns_a, addr_a), (ns_b, addr_b))
    and deletes both namespaces afterwards."""
    prefix = prefix or f"kvrb{os.getpid()}"
    a, b = f"{prefix}-a", f"{prefix}-b"
    made: list[str] = []
    try:
        for i, ns in enumerate((a, b)):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            if i == 0:
                _ip("-n", a, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0b")
        _ip("-n", a, "link", "set", "eth0b", "netns", b)
        _ip("-n", b, "link", "set", "eth0b", "name", "eth0")
        for i, ns in enumerate((a, b)):
            _ip("-n", ns, "addr", "add", f"{TEST_NET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        yield (a, f"{TEST_NET}.1"), (b, f"{TEST_NET}.2")
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
