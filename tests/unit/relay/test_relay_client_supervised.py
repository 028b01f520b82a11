"""The decode side's relay client and tcp pool against faults that used to kill a thread
or leak a resource (issue 21).

A real relay server and a real decode receiver in one process (test_relay_roundtrip's
Prefill and Decode), talking TCP on localhost. Each test ends with a genuine pull from
the same prefill engine that loads its KV: one bad message or one reset must never cut
a decode engine off from a prefill engine.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient
from kvrelay.relay.transports.tcp import TcpTransport
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import expected_output
from tests.unit.relay.test_relay_roundtrip import COMPAT, NBLOCKS, VOCAB, Decode, Prefill

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def genuine_pull_loads(p: Prefill, d: Decode, rid: str) -> None:
    """A fresh lease of ``p`` pulled by ``d``: the KV is loaded (no fallback), the text
    is the colocated one, and both pools end whole."""
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=4, seed=7)
    kv = p.prefill(rid, prompt, params)
    loaded, fallbacks = d.receiver.stats.loaded, dict(d.receiver.stats.fallbacks)
    d.receiver.submit(rid, prompt, params, kv, time.monotonic())
    got = d.run()
    assert [kv.first_token, *got[rid]] == expected_output(7, len(prompt), 4, VOCAB)
    assert d.receiver.stats.fallbacks == fallbacks, d.receiver.stats.fallbacks
    assert d.receiver.stats.loaded == loaded + 1
    assert d.pool.num_free == NBLOCKS
    wait_for(lambda: p.pool.num_free == NBLOCKS, "P's pool to be whole")
    if isinstance(d.transport, TcpTransport):
        assert d.transport._slots == {}, "a finished transfer left its relay's slot entry"


@pytest.mark.parametrize("field", ["lease_id", "engine_id"])
def test_an_oversized_frame_fails_its_request_only(prefill: Prefill, field: str) -> None:
    """Bug (issue 21, trigger a): params whose lease_id (or engine_id) is 2 MiB made
    D's ACQUIRE exceed the frame limit; the ProtocolError killed the relay's sender
    thread, its peer stayed registered, and every later message to that relay was
    queued for ever (the genuine pull fell back `unreachable`). The admission bound of
    the HTTP API stops such params first; this is the client's own guard."""
    d = Decode("tcp")
    try:
        params = SamplingParams(max_tokens=4, seed=1)
        kv = prefill.prefill("big", [1, 2, 3, 4, 5], params)
        forged = dataclasses.replace(kv, **{field: "x" * (2 << 20)})
        d.receiver.submit("big", [1, 2, 3, 4, 5], params, forged, time.monotonic())
        got = d.run()
        assert [kv.first_token, *got["big"]] == expected_output(1, 5, 4, VOCAB)  # recomputed
        assert sum(d.receiver.stats.fallbacks.values()) == 1
        genuine_pull_loads(prefill, d, "genuine")
    finally:
        d.close()


def test_a_prefill_that_resets_right_after_hello_is_reconnected(prefill: Prefill) -> None:
    """Bug (issue 21, trigger b): P closed the control connection right after HELLO
    (a restart, a reset); D's reader dropped the connection (``p.sock = None``) before
    the sender's ``sendall``: AttributeError, the sender thread died, and D never sent
    another message to that P."""
    server = prefill.server
    real = server._handshake
    resets = {"left": 300}

    def hello_then_reset(conn: socket.socket, address: str) -> P.Hello:
        hello = real(conn, address)
        if resets["left"] > 0:
            resets["left"] -= 1
            raise ConnectionResetError("reset right after hello")
        return hello

    server._handshake = hello_then_reset  # type: ignore[method-assign]
    d = Decode("tcp")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the reader wins the race often
    try:
        relay = server.address
        end, i = time.monotonic() + 20.0, 0
        while resets["left"] > 0:  # each message dials (if no connection), is reset
            assert time.monotonic() < end, (
                f"{resets['left']} resets to go: D stopped dialling this relay")
            d.client.send(relay, P.Abort(10_000 + i, "p-1", "nope", "d-1", "a"))
            i += 1
            time.sleep(0.001)
        d.client.replies.queue.clear()
    finally:
        sys.setswitchinterval(interval)
    try:
        genuine_pull_loads(prefill, d, "after-resets")
    finally:
        d.close()


def test_a_sender_thread_that_cannot_start_fails_its_message_only(
    prefill: Prefill, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bug (issue 21): ``send`` registered the relay's peer before ``thread.start()``;
    a start that failed (no room for threads) raised into the engine loop's receiver
    tick and left a peer no thread would ever serve. Now the message is answered
    (code unreachable) and no peer is left behind."""
    d = Decode("tcp")
    real_start = threading.Thread.start

    def no_room(self: threading.Thread) -> None:
        if self.name.startswith("relay-"):
            raise RuntimeError("can't start new thread")
        real_start(self)

    try:
        monkeypatch.setattr(threading.Thread, "start", no_room)
        d.client.send(prefill.server.address, P.Abort(5, "p-1", "nope", "d-1", "a"))
        reply = d.client.replies.get(timeout=5.0)
        assert (reply.seq, reply.status, reply.code) == (5, "error", "unreachable")
        assert d.client.sender_threads == 0
        monkeypatch.setattr(threading.Thread, "start", real_start)
        genuine_pull_loads(prefill, d, "after-no-room")
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        d.close()


def test_a_reader_thread_that_cannot_start_fails_its_message_only(
    prefill: Prefill, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sender's reader thread failing to start must fail that message and drop the
    connection (a connection nobody reads is useless), never kill the sender."""
    d = Decode("tcp")
    real_start = threading.Thread.start

    def no_reader(self: threading.Thread) -> None:
        if self.name.startswith("relay-read-"):
            raise RuntimeError("can't start new thread")
        real_start(self)

    try:
        monkeypatch.setattr(threading.Thread, "start", no_reader)
        d.client.send(prefill.server.address, P.Abort(6, "p-1", "nope", "d-1", "a"))
        reply = d.client.replies.get(timeout=5.0)
        assert (reply.seq, reply.status, reply.code) == (6, "error", "unreachable")
        monkeypatch.setattr(threading.Thread, "start", real_start)
        genuine_pull_loads(prefill, d, "after-no-reader")
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        d.close()


def test_the_tcp_pool_is_capped_and_ages_out_relays_never_named_again() -> None:
    """Bug (issue 21): pooled data sockets were kept per relay string without a cap,
    and dropped only when the same string was used again: each spelling of a relay
    left a socket for ever (CLOSE_WAIT once P closed its end, and one of P's
    per-address slots). Now at most ``max_idle`` in all, each closed after ``idle_s``
    whichever relay asks next."""
    ends: list[socket.socket] = []

    def connect(relay: str) -> socket.socket:
        mine, theirs = socket.socketpair()
        ends.append(theirs)
        return mine

    t = TcpTransport(connect=connect, max_idle=4, idle_s=0.3)
    try:
        given = []
        for i in range(10):
            sock, pooled = t._take(f"relay-{i}:9000")
            assert not pooled
            t._give_back(f"relay-{i}:9000", sock)
            given.append(sock)
        assert [s.fileno() == -1 for s in given] == [True] * 6 + [False] * 4
        assert sum(len(v) for v in t._idle.values()) == 4
        time.sleep(0.35)  # older than idle_s: whoever takes next sweeps them
        sock, pooled = t._take("another:9000")
        assert not pooled and all(s.fileno() == -1 for s in given) and t._idle == {}
        sock.close()
    finally:
        t.close()
        for e in ends:
            e.close()


def test_senders_are_capped_at_max_relays_least_recently_used_first(prefill: Prefill) -> None:
    """Bug (issue 21): one sender thread per relay a client named, without a cap (300
    spellings: 300 threads). At max_relays the least recently used sender is retired
    (after sending what it had queued); every message is still answered."""
    dead = []
    for _ in range(8):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead.append(f"127.0.0.1:{s.getsockname()[1]}")
    before = threading.active_count()
    client = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1", max_relays=3,
                         connect_timeout=0.5)
    try:
        for i, relay in enumerate(dead):
            client.send(relay, P.Abort(i + 1, "p-1", "nope", "d-1", "a"))
            assert client.sender_threads <= 3
        replies = [client.replies.get(timeout=10.0) for _ in dead]
        assert sorted(r.seq for r in replies) == list(range(1, 9))
        assert {r.code for r in replies} == {"unreachable"}
        wait_for(lambda: threading.active_count() <= before + 3, "retired senders to end")
        client.send(prefill.server.address, P.Abort(99, "p-1", "nope", "d-1", "a"))
        reply = client.replies.get(timeout=5.0)
        assert reply.seq == 99 and reply.code == "unknown_lease"
    finally:
        client.close()
