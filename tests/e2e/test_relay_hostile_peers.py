"""A real prefill relay process against hostile peers, and its stale shm segment.

The prefill engine runs as its own process (tests/e2e/relay_node.py); the hostile
peers are raw sockets of this process, from several loopback addresses
(127.0.0.2, ...: all loopback on Linux) so the per-address cap can be told apart
from the global one. Bounds are scaled down (1 s frame timeout) to keep the tests
short; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient
from kvrelay.testing.kv import TINY_GEOMETRY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NODE = Path(__file__).with_name("relay_node.py")
ROOT = NODE.parents[2]
COMPAT = TINY_GEOMETRY.compat_hash()
SECRET = "s3cret"
E = P.ErrorCode


class Node:
    """relay_node.py prefill in its own process group (as a container would be)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(NODE), "prefill", *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True,
        )
        self.hello = self.call(None)
        host, port = self.hello["relay"].split(":")
        self.addr = (host, int(port))

    def call(self, cmd: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.poll()}"
        return dict(json.loads(line))

    def server_stats(self) -> dict[str, int]:
        return dict(self.call({"op": "stats"})["server"])

    def kill_group(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # P and its resource tracker
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill_group()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node("--secret", SECRET, "--max-connections", "24", "--max-per-address", "8",
             "--handshake-timeout", "3", "--frame-timeout", "1", "--idle-timeout", "30")
    yield n
    n.close()


def dial(addr: tuple[str, int], source: str) -> tuple[socket.socket, P.Message]:
    s = socket.create_connection(addr, timeout=10.0, source_address=(source, 0))
    return s, P.recv_frame(s)


def authenticate(s: socket.socket, challenge: P.Challenge) -> P.Reply:
    h = P.Hello(0, P.PROTOCOL_VERSION, COMPAT, "block_major", "tcp", "flood")
    h.mac = P.hello_mac(SECRET.encode(), challenge.nonce, h)
    s.sendall(P.encode(h))
    reply = P.recv_frame(s)
    assert isinstance(reply, P.Reply)
    return reply


def closed_with_error(s: socket.socket) -> str:
    """Wait (bounded by the socket timeout) for P to answer and close; its code."""
    try:
        reply = P.recv_frame(s)
    except (ConnectionError, TimeoutError):
        return "closed"
    assert isinstance(reply, P.Reply) and reply.status == "error"
    with contextlib.suppress(ConnectionResetError):
        assert s.recv(1) == b""
    return reply.code


def d_client() -> RelayClient:
    return RelayClient(compat=COMPAT, transport="tcp", client_id="d-1", secret=SECRET.encode())


def wait_open(node: Node, n: int, limit_s: float = 15.0) -> None:
    end = time.monotonic() + limit_s
    while node.server_stats()["open"] != n:
        assert time.monotonic() < end, f"relay kept {node.server_stats()['open']} connections"
        time.sleep(0.1)


def test_stalled_after_hello_flood_cannot_pin_the_relay(node: Node) -> None:
    """Bug: 270 connections that finished HELLO and stalled mid-frame held the
    relay's slots for as long as they stayed open (no timeout after HELLO)."""
    stalled: list[socket.socket] = []
    refused: list[str] = []
    try:
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            for _ in range(12):  # 12 > the per-address cap of 8
                s, first = dial(node.addr, source)
                if isinstance(first, P.Reply):
                    refused.append(first.code)
                    assert "max_connections_per_address" in first.error
                    s.close()
                    continue
                assert isinstance(first, P.Challenge)
                assert authenticate(s, first).status == "ok"
                s.sendall(P.encode(P.Abort(1, "x", "L", "flood", "a"))[:3])  # then stall
                stalled.append(s)
        assert len(stalled) == 24 and refused == [E.REFUSED.value] * 12
        # Every slot is held by a stalled frame (a decode engine dialling now is refused
        # with code `refused`), but only until the frame timeout: each stalled peer is
        # answered (`bad_frame`) and closed, and decode engines are served again.
        codes = [closed_with_error(s) for s in stalled]
        assert codes == [E.BAD_FRAME.value] * 24
        sock, peer = d_client().open(f"{node.addr[0]}:{node.addr[1]}")
        sock.close()
        assert peer.engine_id
        stats = node.server_stats()
        assert stats["frame_timeouts"] >= 24 and stats["refused"] >= 12
    finally:
        for s in stalled:
            s.close()
    wait_open(node, 0)


def test_authenticated_decode_is_served_while_peers_sit_in_the_handshake(node: Node) -> None:
    """Bug: with --relay-secret an authenticated decode engine was refused while 270
    peers sat in the handshake."""
    sitting: list[socket.socket] = []
    try:
        for source in ("127.0.0.5", "127.0.0.6", "127.0.0.7"):
            for _ in range(8):
                s, first = dial(node.addr, source)
                assert isinstance(first, P.Challenge)
                sitting.append(s)  # says nothing: sits in the handshake
        before = node.server_stats()
        assert before["open"] == 24
        # Served at once, on the first try: it takes the oldest handshake's slot.
        sock, peer = d_client().open(f"{node.addr[0]}:{node.addr[1]}")
        with sock:
            assert peer.engine_id
            after = node.server_stats()
            assert after["evicted"] - before["evicted"] == 1
            assert after["open"] == 24
        # The evicted peer was closed; the others are still within their deadline and
        # then are cut off by it (3 s total), whatever they do.
        assert closed_with_error(sitting[0]) in ("closed", E.BAD_FRAME.value)
        for s in sitting[1:]:
            assert closed_with_error(s) == E.BAD_FRAME.value
    finally:
        for s in sitting:
            s.close()
    wait_open(node, 0)


def test_handshakes_from_one_address_cannot_lock_out_a_decode_engine_there() -> None:
    """Bug (issue 21): at the per-address cap (64) a connection was refused outright;
    only at the global cap was the oldest handshake evicted. So 64 unauthenticated
    connections from 127.0.0.1 (the same host, a NAT) locked out a decode engine there
    that knows the secret: "too many connections from 127.0.0.1". Now the oldest
    handshake from that address gives way."""
    n = Node("--secret", SECRET, "--handshake-timeout", "20")  # default caps: 256, 64
    sitting: list[socket.socket] = []
    try:
        for _ in range(64):
            s, first = dial(n.addr, "127.0.0.1")
            assert isinstance(first, P.Challenge), first
            sitting.append(s)  # says nothing: sits in the handshake
        before = n.server_stats()
        assert before["open"] == 64
        sock, peer = d_client().open(f"{n.addr[0]}:{n.addr[1]}")
        with sock:
            assert peer.engine_id
            after = n.server_stats()
            assert after["evicted"] - before["evicted"] == 1
            assert after["refused_per_address"] == before["refused_per_address"]
            assert after["open"] == 64
        assert closed_with_error(sitting[0]) == "closed"  # the oldest one gave way
    finally:
        for s in sitting:
            s.close()
        n.close()


def test_a_killed_prefill_groups_shm_segment_is_swept_by_the_next_prefill() -> None:
    """Bug: when P's resource tracker died with P (process group or container killed)
    its /dev/shm/kvrelay-* segment stayed for good."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    old = Node()
    seg = Path("/dev/shm") / old.hello["shm"]
    assert seg.exists() and seg.name.split("-")[2] == str(old.proc.pid)
    old.kill_group()
    assert seg.exists(), "the resource tracker survived: nothing left to sweep"
    new = Node()
    try:
        assert not seg.exists(), "the new prefill engine did not sweep the stale segment"
        assert (Path("/dev/shm") / new.hello["shm"]).exists()
    finally:
        new.close()
    assert not (Path("/dev/shm") / new.hello["shm"]).exists()
