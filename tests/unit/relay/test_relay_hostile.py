"""The relay's edges against hostile or broken peers, over real sockets on localhost.

A prefill relay server in this process (lease table, real sockets, threads); the
peers are raw sockets speaking the protocol by hand, or the real ``RelayClient`` and
transports. Each test names the issue-9 bug it pins; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.core.kv_port import PoolLeaseBlocks
from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient, RelayUnavailable
from kvrelay.relay.lease import LeaseState, LeaseTable
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports import shm as shm_mod
from kvrelay.relay.transports.base import PeerInfo, TransferState, TransferStatus, byte_view
from kvrelay.relay.transports.shm import ShmKvCache, ShmTransport, sweep_stale_segments
from kvrelay.relay.transports.tcp import TcpTransport

COMPAT = "compat-test"
NBLOCKS = 16
BLOCK_FLOATS = 64  # 256 bytes per block
E = P.ErrorCode


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


class Prefill:
    def __init__(self, block_floats: int = BLOCK_FLOATS, **config: object) -> None:
        self.kv = torch.arange(NBLOCKS * block_floats, dtype=torch.float32).reshape(
            NBLOCKS, block_floats)
        self.pool = BlockPool(NBLOCKS)
        self.lock = threading.Lock()
        self.table = LeaseTable(PoolLeaseBlocks(self.pool), engine_id="p-1", acquire_timeout=30.0,
                                hard_cap=60.0)
        cfg = RelayServerConfig(compat=COMPAT, transports={"tcp": {}}, **config)  # type: ignore[arg-type]
        self.server = RelayServer(self.table, self.lock, cfg,
                                  kv_bytes=byte_view(self.kv)).start()
        host, port = self.server.address.split(":")
        self.addr = (host, int(port))

    def lease(self, rid: str, nblocks: int = 4) -> tuple[str, list[int]]:
        with self.lock:
            ids = self.pool.allocate(nblocks, request_owner(rid))
            lease = self.table.create(rid, ids, time.monotonic(), num_tokens=nblocks * 4,
                                      first_token=1)
        return lease.lease_id, ids

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


def hello(addr: tuple[str, int], client_id: str = "d-1", *, version: int = P.PROTOCOL_VERSION,
          secret: bytes | None = None, source: str | None = None) -> tuple[socket.socket, P.Reply]:
    """A raw connection through HELLO; returns it with P's answer to HELLO."""
    s = socket.create_connection(addr, timeout=5.0,
                                 source_address=(source, 0) if source else None)
    ch = P.recv_frame(s)
    if isinstance(ch, P.Reply):  # refused at accept
        return s, ch
    assert isinstance(ch, P.Challenge)
    h = P.Hello(0, version, COMPAT, "block_major", "tcp", client_id)
    if secret is not None:
        h.mac = P.hello_mac(secret, ch.nonce, h)
    s.sendall(P.encode(h))
    reply = P.recv_frame(s)
    assert isinstance(reply, P.Reply)
    return s, reply


def call(s: socket.socket, msg: P.Request) -> P.Reply:
    s.sendall(P.encode(msg))
    reply = P.recv_frame(s)
    assert isinstance(reply, P.Reply)
    return reply


def closed_by_peer(s: socket.socket) -> bool:
    """Reads what is left; True once P closed the connection (EOF or reset)."""
    try:
        while True:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- HELLO -----------------------------------------------------------------------------


def test_hello_payload_version_is_checked(prefill: Prefill) -> None:
    """Bug: HELLO's payload version was never checked."""
    s, reply = hello(prefill.addr, version=P.PROTOCOL_VERSION + 7)
    with s:
        assert reply.status == "error" and reply.code == E.REFUSED.value
        assert "version" in reply.error
        assert closed_by_peer(s)
    # A frame header of another version is refused the same way.
    with socket.create_connection(prefill.addr, timeout=5.0) as s:
        assert isinstance(P.recv_frame(s), P.Challenge)
        payload = P.encode(P.Hello(0, 1, COMPAT, "block_major", "tcp", "d"))
        s.sendall(payload[:2] + bytes([1]) + payload[3:])
        reply = P.recv_frame(s)
        assert isinstance(reply, P.Reply) and reply.code == E.REFUSED.value
        assert closed_by_peer(s)


def test_auth_failure_is_answered_at_once_logged_and_surfaced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bug: a D with the wrong secret waited its full timeout and reported
    `unreachable`, and neither side logged anything."""
    p = Prefill(secret=b"s3cret")
    try:
        caplog.set_level(logging.WARNING)
        bad = RelayClient(compat=COMPAT, transport="tcp", client_id="d-bad", secret=b"wrong",
                          connect_timeout=30.0, retry_after_s=60.0)
        with pytest.raises(RelayUnavailable) as info:
            bad.open(p.server.address)
        assert info.value.code is E.AUTH_FAILED
        # The receiver's messages are answered by the client itself, at once, with the
        # code; within retry_after_s it does not dial again for each of them.
        for seq in (41, 42, 43):
            bad.send(p.server.address, P.Acquire(seq, "p-1", "L", "d-bad", "a-1"))
        for seq in (41, 42, 43):
            reply = bad.replies.get(timeout=5.0)
            assert (reply.seq, reply.status, reply.code) == (seq, "error", "auth_failed")
        bad.close()
        server_logs = [r for r in caplog.records if r.name == "kvrelay.relay.server"]
        client_logs = [r for r in caplog.records if r.name == "kvrelay.relay.client"]
        assert any("127.0.0.1" in r.getMessage() and "d-bad" in r.getMessage()
                   for r in server_logs), "P must log the failure with the peer address"
        assert any("auth_failed" in r.getMessage() for r in client_logs)
        assert p.server.stats.auth_failures == 2
        failures = p.server.samples()["kvrelay_relay_hello_failures_total"]
        assert failures[("auth_failed",)] == 2.0
    finally:
        p.close()


def test_a_relay_that_cannot_prove_the_secret_is_refused() -> None:
    """Authentication is mutual: a decode engine with a secret talks to no relay that
    does not prove it (a forged relay named in a client's params could otherwise feed
    it KV that its prefix cache would share with other clients)."""
    listener = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{listener.getsockname()[1]}"

    def forged_relay() -> None:  # says ok to any HELLO, proves nothing
        conn, _ = listener.accept()
        with conn:
            conn.sendall(P.encode(P.Challenge("p-forged", secrets.token_bytes(16))))
            hello = P.recv_frame(conn, frame_timeout=5.0)
            assert isinstance(hello, P.Hello) and len(hello.nonce) == 16
            conn.sendall(P.encode(P.Reply(hello.seq, "ok", engine_id="p-forged",
                                          mac=b"\0" * 32)))
            with contextlib.suppress(OSError):
                conn.recv(1)

    t = threading.Thread(target=forged_relay, daemon=True)
    t.start()
    d = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1", secret=b"s3cret")
    with pytest.raises(RelayUnavailable) as info:
        d.open(addr)
    assert info.value.code is E.AUTH_FAILED and "did not prove" in str(info.value)
    t.join(5)
    listener.close()
    # The genuine relay proves it.
    p = Prefill(secret=b"s3cret")
    try:
        sock, _ = d.open(p.server.address)
        sock.close()
    finally:
        p.close()


def test_a_relay_forwarding_the_handshake_to_a_real_prefill_is_refused() -> None:
    """Review finding: a client may name any relay address in its params; a relay that
    forwarded the handshake to a genuine P passed on P's proof, and D then took (and
    published) whatever bytes it chose. P's proof now covers the address P advertises,
    which D checks against the address it dialled."""
    p = Prefill(secret=b"s3cret")
    listener = socket.create_server(("127.0.0.1", 0))
    forwarder = f"127.0.0.1:{listener.getsockname()[1]}"

    def pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def forward() -> None:
        conn, _ = listener.accept()
        upstream = socket.create_connection(p.addr)
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)

    t = threading.Thread(target=forward, daemon=True)
    t.start()
    try:
        d = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1", secret=b"s3cret")
        with pytest.raises(RelayUnavailable) as info:
            d.open(forwarder)
        assert info.value.code is E.AUTH_FAILED
        sock, _ = d.open(p.server.address)  # the genuine address: proved
        sock.close()
    finally:
        listener.close()
        p.close()


def test_which_relays_a_decode_engine_trusts_with_its_prefix_cache() -> None:
    plain = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1")
    assert plain.trusted("127.0.0.1:9000") and plain.trusted("localhost:9000")
    assert plain.trusted("[::1]:9000") and plain.trusted("127.8.0.1:9000")
    assert not plain.trusted("10.0.0.7:9000") and not plain.trusted("example.com:9000")
    keyed = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1", secret=b"k")
    assert keyed.trusted("10.0.0.7:9000")  # every relay it talks to proved the secret


def test_client_codes_for_refused_and_unreachable(prefill: Prefill) -> None:
    wrong = RelayClient(compat="other", transport="tcp", client_id="d")
    wrong.send(prefill.server.address, P.Heartbeat(5, "p-1", "L", "d", "a"))
    reply = wrong.replies.get(timeout=5.0)
    assert (reply.seq, reply.code) == (5, "refused") and "mismatch" in reply.error
    wrong.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    client = RelayClient(compat=COMPAT, transport="tcp", client_id="d")
    client.send(dead, P.Heartbeat(6, "p-1", "L", "d", "a"))
    reply = client.replies.get(timeout=5.0)
    assert (reply.seq, reply.code) == (6, "unreachable")
    client.close()


def test_hello_deadline_is_total_not_renewed_by_trickled_bytes() -> None:
    """Bug: before HELLO the 5 s read timeout was renewed by every byte a peer sent."""
    p = Prefill(handshake_timeout=0.5)
    try:
        with socket.create_connection(p.addr, timeout=5.0) as s:
            assert isinstance(P.recv_frame(s), P.Challenge)
            frame = P.encode(P.Hello(0, P.PROTOCOL_VERSION, COMPAT, "block_major", "tcp", "d"))
            s.settimeout(0.1)
            closed = False
            for b in frame[:40]:  # one byte every 0.1 s: 4 s if it were never cut
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    closed = True
                    break
                if closed_by_peer(s):
                    closed = True
                    break
            assert closed, "P kept a trickling handshake open"
        assert p.server.stats.frame_timeouts == 1
        wait_for(lambda: p.server.open_connections == 0, "the slot to be freed")
    finally:
        p.close()


# -- after HELLO -----------------------------------------------------------------------


def test_holder_must_be_the_connections_hello_client(prefill: Prefill) -> None:
    """Bug: the holder named in a message was not bound to the connection's HELLO."""
    lease_id, _ = prefill.lease("r")
    s, reply = hello(prefill.addr, "d-1")
    with s:
        assert reply.status == "ok"
        r = call(s, P.Acquire(1, "p-1", lease_id, "d-2", "a-1"))
        assert (r.status, r.code) == ("error", E.NOT_HOLDER.value)
        with prefill.lock:
            assert prefill.table.leases[lease_id].state is LeaseState.HELD
        r = call(s, P.Read(2, "p-1", lease_id, "d-2", "a-1", [0]))
        assert r.code == E.NOT_HOLDER.value
        r = call(s, P.Acquire(3, "p-1", lease_id, "d-1", "a-1"))  # its own name: served
        assert r.status == "ok"
    assert prefill.server.stats.not_holder == 2


def test_a_hello_without_a_client_id_is_refused(prefill: Prefill) -> None:
    """Bug: with client_id "" every lease message's holder "" matched the connection,
    and an ABORT without a holder is the in-process proxy's: valid against any live
    lease, whoever pulls it (and every part of a split lease)."""
    lease_id, _ = prefill.lease("r")
    s, reply = hello(prefill.addr, "")
    with s:
        assert reply.status == "error" and reply.code == E.REFUSED.value
        assert "client_id" in reply.error
        assert closed_by_peer(s)
    with prefill.lock:
        assert prefill.table.leases[lease_id].state is LeaseState.HELD


def test_read_one_block_2000_times_is_refused_after_the_first(prefill: Prefill) -> None:
    """Bug: a holder could READ one block 2,000 times (2 KB of requests -> 737 MB)."""
    lease_id, ids = prefill.lease("r")
    block_bytes = BLOCK_FLOATS * 4
    ctl, _ = hello(prefill.addr, "d-1")
    data, _ = hello(prefill.addr, "d-1")
    with ctl, data:
        assert call(ctl, P.Acquire(1, "p-1", lease_id, "d-1", "a-1")).status == "ok"
        r = call(data, P.Read(2, "p-1", lease_id, "d-1", "a-1", [ids[0]]))
        assert (r.status, r.nbytes) == ("ok", block_bytes)
        got = P.read_exact(data, block_bytes)
        assert got == prefill.kv[ids[0]].numpy().tobytes()
        streamed, refused = 0, 0
        for i in range(2000):
            r = call(data, P.Read(10 + i, "p-1", lease_id, "d-1", "a-1", [ids[0]]))
            if r.status != "ok":
                refused += 1
                assert r.code == E.READ_DENIED.value and "already read" in r.error
                break
            streamed += len(P.read_exact(data, r.nbytes))
        assert (streamed, refused) == (0, 1)
        # Another attempt of the same engine reads nothing; blocks outside the lease
        # neither; the holding attempt still gets the blocks it has not read yet.
        r = call(data, P.Read(3, "p-1", lease_id, "d-1", "a-2", [ids[1]]))
        assert r.code == E.NOT_HOLDER.value
        other = next(b for b in range(NBLOCKS) if b not in ids)
        r = call(data, P.Read(4, "p-1", lease_id, "d-1", "a-1", [ids[1], other]))
        assert r.code == E.READ_DENIED.value
        r = call(data, P.Read(5, "p-1", lease_id, "d-1", "a-1", ids[1:]))
        assert r.status == "ok" and len(P.read_exact(data, r.nbytes)) == 3 * block_bytes
    # counted after the stream went out: wait for the server thread to count it
    wait_for(lambda: prefill.server.stats.bytes_sent >= 4 * block_bytes, "the count")
    assert prefill.server.stats.bytes_sent == 4 * block_bytes


@pytest.mark.parametrize("ended_under_the_stream", [False, True])
def test_a_read_that_commits_gets_the_fence_of_release_ok(ended_under_the_stream: bool) -> None:
    """Read.commit: P commits once its last send returned and sends the verdict after
    the bytes. The verdict is RELEASE(ok)'s: a lease released while P streamed (here it
    expires while the stream waits for D to read) is refused, never ``done``."""
    p = Prefill(block_floats=1 << 20)  # 4 MiB blocks: 32 MiB do not fit socket buffers
    try:
        lease_id, ids = p.lease("r", nblocks=8)
        ctl, _ = hello(p.addr, "d-1")
        data, _ = hello(p.addr, "d-1")
        data.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        with ctl, data:
            assert call(ctl, P.Acquire(1, "p-1", lease_id, "d-1", "a-1")).status == "ok"
            r = call(data, P.Read(2, "p-1", lease_id, "d-1", "a-1", ids, commit=True))
            assert r.status == "ok"
            if ended_under_the_stream:
                with p.lock:  # P is still sending: D has not read a byte yet
                    assert [x.lease_id for x in p.table.expire(time.monotonic() + 3600)
                            ] == [lease_id]
            got = P.read_exact(data, r.nbytes)
            verdict = P.recv_frame(data)
            assert isinstance(verdict, P.Reply)
            assert got == p.kv[ids].numpy().tobytes()
            if ended_under_the_stream:
                assert (verdict.status, verdict.reason) == ("released", "expired")
            else:
                assert (verdict.status, verdict.reason) == ("ok", "done")
            # The commit was the lease's one release: a RELEASE(ok) now changes nothing.
            again = call(ctl, P.Release(3, "p-1", lease_id, "d-1", "a-1", True))
            assert (again.status, again.reason) == (verdict.status, verdict.reason)
        assert p.pool.num_free == NBLOCKS
    finally:
        p.close()


def test_a_read_stream_nobody_takes_ends_the_connection() -> None:
    """A peer that asks for a lease's bytes and never reads them holds P's thread
    and slot for send_timeout only (16 MiB: more than the socket buffers hold)."""
    p = Prefill(block_floats=256 * 1024, send_timeout=0.3)
    try:
        lease_id, ids = p.lease("r", nblocks=16)
        ctl, _ = hello(p.addr, "d-1")
        data, _ = hello(p.addr, "d-1")
        with ctl, data:
            assert call(ctl, P.Acquire(1, "p-1", lease_id, "d-1", "a")).status == "ok"
            data.sendall(P.encode(P.Read(2, "p-1", lease_id, "d-1", "a", ids)))
            wait_for(lambda: p.server.open_connections == 1, "the stalled stream to end")
            assert p.server.stats.bytes_sent == 0
    finally:
        p.close()


def test_idle_connection_is_closed_and_the_tcp_transport_reconnects() -> None:
    """An idle authenticated connection does not hold its slot forever, and the
    decode side's pooled data connection that P closed is replaced, not a failure."""
    p = Prefill(idle_timeout=0.3)
    client = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1")
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    tr = TcpTransport(dst, connect=client.open_data, io_timeout=5.0)
    try:
        peer = PeerInfo(p.server.address, "p-1")
        for n in range(2):
            lease_id, ids = p.lease(f"r{n}")
            ctl, _ = hello(p.addr, "d-1")
            with ctl:
                assert call(ctl, P.Acquire(1, "p-1", lease_id, "d-1", "a")).status == "ok"
            h = tr.read(peer, lease_id, "d-1", ids, ids, attempt="a")
            wait_for(lambda h=h: h.status.state is not TransferState.PENDING, "transfer")
            assert h.status.state is TransferState.DONE, h.status.error
            assert torch.equal(dst[ids], p.kv[ids])
            # P closes the idle pooled data connection (and the control one).
            wait_for(lambda: p.server.open_connections == 0, "idle connections to close")
        # two data connections closed idle (the control ones we closed ourselves): the
        # second transfer dialled anew instead of failing on the dead pooled one
        assert (p.server.stats.idle_closed, p.server.stats.connections) == (2, 4)
    finally:
        tr.close()
        client.close()
        p.close()


def test_refused_connection_gets_a_reply_with_code_refused() -> None:
    p = Prefill(max_connections=4, max_connections_per_address=2)
    socks: list[socket.socket] = []
    try:
        for _ in range(2):
            s, reply = hello(p.addr, "d-1")
            socks.append(s)
            assert reply.status == "ok"
        s, reply = hello(p.addr, "d-1")
        socks.append(s)
        assert (reply.status, reply.code) == ("error", E.REFUSED.value)
        assert "max_connections_per_address" in reply.error and closed_by_peer(s)
        client = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1")
        with pytest.raises(RelayUnavailable) as info:
            client.open(p.server.address)
        assert info.value.code is E.REFUSED
        # Another address is under its own cap (127.0.0.2 is loopback too).
        s, reply = hello(p.addr, "d-2", source="127.0.0.2")
        socks.append(s)
        assert reply.status == "ok"
        assert p.server.stats.refused == 2
        got = p.server.samples()
        assert got["kvrelay_relay_connections_refused_total"] == {
            ("max_connections_per_address",): 2.0, ("max_connections",): 0.0}
        assert got["kvrelay_relay_connections"] == {(): 3.0}
    finally:
        for s in socks:
            s.close()
        p.close()


def test_server_close_closes_every_connection(prefill: Prefill) -> None:
    socks = [hello(prefill.addr, f"d-{i}")[0] for i in range(3)]
    prefill.server.close()
    try:
        assert all(closed_by_peer(s) for s in socks)
        assert prefill.server.open_connections == 0
        with pytest.raises(OSError):
            socket.create_connection(prefill.addr, timeout=2.0).close()
    finally:
        for s in socks:
            s.close()


# -- the decode side -------------------------------------------------------------------


def test_idle_sender_threads_are_reaped(prefill: Prefill) -> None:
    """Bug (issue 6): each distinct relay address started a sender thread never reaped."""
    before = threading.active_count()
    client = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1", idle_s=0.2)
    dead = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead.append(f"127.0.0.1:{s.getsockname()[1]}")
    for i, relay in enumerate([prefill.server.address, *dead]):
        client.send(relay, P.Abort(i + 1, "p-1", "nope", "d-1", "a"))
    got = sorted(client.replies.get(timeout=5.0).code for _ in range(4))
    assert got == ["unknown_lease", "unreachable", "unreachable", "unreachable"] or \
        got[1:] == ["unreachable"] * 3  # the lead's lease table names unknown leases
    assert client.sender_threads == 4
    wait_for(lambda: client.sender_threads == 0, "idle senders to retire")
    wait_for(lambda: threading.active_count() <= before, "their threads to end")
    # A later send starts a fresh sender and is delivered.
    client.send(prefill.server.address, P.Abort(9, "p-1", "nope", "d-1", "a"))
    assert client.replies.get(timeout=5.0).seq == 9
    client.close()


class FrozenPrefill:
    """A fake relay that answers a READ with `ok`, sends half the bytes, then freezes."""

    def __init__(self, nbytes: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.nbytes = nbytes
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def relay(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            self.conns.append(conn)
            msg = P.recv_frame(conn)
            assert isinstance(msg, P.Read)
            conn.sendall(P.encode(P.Reply(msg.seq, "ok", nbytes=self.nbytes)))
            conn.sendall(b"\0" * (self.nbytes // 2))

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.listener.close()


def test_tcp_read_from_a_prefill_frozen_mid_copy_fails_within_io_timeout() -> None:
    """Bug: the data socket had no timeout: a P frozen mid-copy held D for --lease-max."""
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    fake = FrozenPrefill(4 * BLOCK_FLOATS * 4)
    tr = TcpTransport(dst, connect=lambda relay: socket.create_connection(
        ("127.0.0.1", int(relay.rsplit(":", 1)[1])), timeout=2.0), io_timeout=0.3)
    try:
        h = tr.read(PeerInfo(fake.relay, "p"), "L", "d", [0, 1, 2, 3], [0, 1, 2, 3])
        wait_for(lambda: h.status.state is not TransferState.PENDING, "the read to fail")
        assert h.status.state is TransferState.FAILED
        assert "no progress" in h.status.error
    finally:
        tr.close()
        fake.close()


def test_tcp_transport_opens_at_most_max_per_relay_data_connections() -> None:
    """However many loads D runs, it stays under P's per-address cap; transfers that
    wait for a connection can still be cancelled."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])  # never answers a READ

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    tr = TcpTransport(dst, connect=lambda relay: socket.create_connection(
        ("127.0.0.1", port), timeout=2.0), io_timeout=30.0, max_per_relay=2)
    try:
        handles = [tr.read(PeerInfo(f"127.0.0.1:{port}", "p"), f"L{i}", "d", [i], [i])
                   for i in range(5)]
        wait_for(lambda: len(accepted) == 2, "two data connections")
        time.sleep(0.3)  # the other three wait for a slot instead of dialling
        assert len(accepted) == 2
        for h in handles:
            tr.cancel(h)
        wait_for(lambda: all(tr.poll(h).state is TransferState.FAILED for h in handles),
                 "every transfer to stop")
    finally:
        tr.close()
        listener.close()
        for c in accepted:
            c.close()


def test_transport_threads_turn_any_exception_into_a_failed_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bug: transport threads caught only the exceptions they listed: anything else
    killed the thread and left the handle PENDING forever."""
    def boom(*args: object, **kw: object) -> None:
        raise ZeroDivisionError("unexpected")

    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    tcp = TcpTransport(dst, connect=boom)  # type: ignore[arg-type]
    cache = ShmKvCache()
    cache.factory((NBLOCKS, BLOCK_FLOATS), torch.float32)
    monkeypatch.setattr(shm_mod, "copy_blocks", boom)
    shm = ShmTransport(dst)
    try:
        handles = [
            (tcp, tcp.read(PeerInfo("127.0.0.1:1", "p"), "L", "d", [0], [0])),
            (shm, shm.read(PeerInfo("x", "p", cache.descriptor()), "L", "d", [0], [0])),
        ]
        for tr, h in handles:
            wait_for(lambda tr=tr, h=h: tr.poll(h).state is not TransferState.PENDING,
                     f"{tr.name} to report")
            status: TransferStatus = tr.poll(h)
            assert status.state is TransferState.FAILED and "ZeroDivisionError" in status.error
    finally:
        shm.close()
        cache.close()


# -- stale shm segments ----------------------------------------------------------------


def test_sweep_removes_only_our_kvrelay_segments_whose_owner_is_gone(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead_pid = proc.pid
    tag = secrets.token_hex(16)
    ns = shm_mod.pid_namespace()
    names = {
        "dead": f"kvrelay-{ns}-{dead_pid}-{tag}",
        "alive": f"kvrelay-{ns}-1-{tag}",  # pid 1 started before the segment
        "ours": f"kvrelay-{ns}-{os.getpid()}-{tag}",
        "other_namespace": f"kvrelay-{ns + 1}-{dead_pid}-{tag}",  # its pids are not ours
        "old_format": f"kvrelay-{tag}",  # no owner pid: cannot tell, left alone
        "foreign": f"other-{ns}-{dead_pid}-{tag}",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x" * 10)
    removed = sweep_stale_segments(str(tmp_path))
    assert removed == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "dead")
    assert shm_mod._owner_gone(os.getpid(), time.time()) is False
    # A live process that started after the segment was made only reuses the pid.
    assert shm_mod._owner_gone(os.getpid(), time.time() - 10 * 365 * 86400) is True


# -- frame-level bounds ------------------------------------------------------------------


def test_recv_frame_bounds_idle_start_and_a_started_frame() -> None:
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(P.IdleTimeout):
            P.recv_frame(a, start_by=time.monotonic() + 0.05, frame_timeout=5.0)
        frame = P.encode(P.Challenge("p", b"n"))
        b.sendall(frame[:5])  # started, then stalled
        with pytest.raises(P.FrameTimeout, match="not completed"):
            P.recv_frame(a, start_by=time.monotonic() + 5.0, frame_timeout=0.05)
    a, b = socket.socketpair()
    with a, b:
        b.sendall(P.encode(P.Challenge("p", b"n")))
        assert P.recv_frame(a, start_by=time.monotonic() + 5.0, frame_timeout=5.0) == \
            P.Challenge("p", b"n")
        frame = bytearray(P.encode(P.Challenge("p", b"n")))
        frame[2] = 1
        b.sendall(bytes(frame))
        with pytest.raises(P.VersionMismatch) as info:
            P.recv_frame(a, frame_timeout=1.0)
        assert info.value.code is E.REFUSED
