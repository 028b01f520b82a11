"""Relay protocol codec: round trips, versions, size limits, malformed frames, HMAC."""

from __future__ import annotations

import pytest

from kvrelay.relay import protocol as P


def roundtrip(msg: P.Message) -> P.Message:
    frame = P.encode(msg)
    n = P.parse_header(frame[: P.HEADER.size])
    assert n == len(frame) - P.HEADER.size
    return P.decode(frame[P.HEADER.size :])


@pytest.mark.parametrize(
    "msg",
    [
        P.Hello(1, P.PROTOCOL_VERSION, "abc", "block_major", "tcp", "d1", b"m"),
        P.Acquire(2, "p", "L", "d1", "a1"),
        P.Heartbeat(3, "p", "L", "d1", "a1"),
        P.Release(4, "p", "L", "d1", "a1", True),
        P.Abort(5, "p", "L", "d1", "a1"),
        P.Read(6, "p", "L", "d1", "a1", [3, 4]),
        P.Reply(7, "ok", block_ids=[1], generations=[0], transport={"name": "x"}),
        P.Reply(8, "error", code=P.ErrorCode.LEASE_BUSY.value, error="busy"),
        P.Challenge("p", b"n"),
    ],
)
def test_every_frame_round_trips(msg: P.Message) -> None:
    assert roundtrip(msg) == msg


def test_wrong_version_and_magic_are_refused() -> None:
    frame = bytearray(P.encode(P.Abort(1, "p", "L", "d1", "a1")))
    frame[2] = 99
    with pytest.raises(P.ProtocolError, match="version 99"):
        P.parse_header(bytes(frame[: P.HEADER.size]))
    with pytest.raises(P.ProtocolError, match="magic"):
        P.parse_header(b"XX" + bytes(frame[2 : P.HEADER.size]))


def test_oversized_and_malformed_frames_are_refused() -> None:
    header = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, 0, P.MAX_FRAME + 1)
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.parse_header(header)
    with pytest.raises(P.ProtocolError, match="malformed"):
        P.decode(b"\xc1garbage")
    with pytest.raises(P.ProtocolError, match="malformed"):
        payload = P.encode(P.Abort(1, "p", "L", "d1", "a1"))[P.HEADER.size :]
        P.decode(payload.replace(b"abort", b"zzzzz"))


def test_hello_mac() -> None:
    hello = P.Hello(1, 1, "c", "block_major", "shm", "d")
    hello.mac = P.hello_mac(b"secret", b"nonce", hello)
    assert P.check_hello_mac(b"secret", b"nonce", hello)
    assert not P.check_hello_mac(b"other", b"nonce", hello)
    assert not P.check_hello_mac(b"secret", b"replayed", hello)
    assert P.check_hello_mac(None, b"nonce", P.Hello(1, 1, "c", "block_major", "shm", "d"))
