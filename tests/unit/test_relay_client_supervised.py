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

from kvrelay.core.fake_runner import expected_output
from kvrelay.relay import protocol as P
from kvrelay.sampling_params import SamplingParams
from tests.unit.test_relay_roundtrip import NBLOCKS, VOCAB, Decode, Prefill

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
