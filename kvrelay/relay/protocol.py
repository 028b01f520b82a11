"""The relay protocol: versioned msgpack frames between a decode engine and P's relay port.

A frame is an 8-byte header, ``b"KR"``, the protocol version (1 byte), a reserved
byte, the payload length (4 bytes, big-endian), then a msgpack payload (msgspec,
tagged structs). Frames above ``MAX_FRAME`` bytes are refused before they are read.

Conversation on one connection:

    P -> D  Challenge(engine_id, nonce)          sent on accept
    D -> P  Hello(version, compat, layout, transport, client_id, nonce, mac)
    P -> D  Reply(ok, engine_id, transport descriptor, mac)   or error, then close
    D -> P  Acquire | Heartbeat | Release | Abort | Read  (each carries a ``seq``)
    P -> D  Reply(seq, ...)                      exactly one per request
            (after a Reply to Read with status ok: ``nbytes`` raw bytes follow)

``mac`` is HMAC-SHA256 over the challenge nonce and the Hello's fields, keyed with
the cluster secret (``--relay-secret``); without a secret it is empty and ignored.
The authentication is mutual: with a secret, P's reply to HELLO carries its own
proof (``relay_proof``, over both nonces), and D talks to no relay that lacks it. A
decode engine shares KV it pulled through its prefix cache, so a forged relay must
never pass for a real one.
Every request names the engine id it believes it talks to, so a restarted P (new
id) refuses leases of its previous life. Lease messages name the holder (the decode
engine's id, which must be the ``client_id`` of the connection's HELLO) and the
``attempt``: a fresh nonce per request attempt on D. A lease is a capability of one
attempt: once acquired, only that attempt may read, heartbeat or release it, and a
``done`` verdict is only ever given to the attempt that committed.

A reply that refuses carries a ``code`` (``ErrorCode``): the decode side acts on the
code, never on the text of ``error``, which is for people.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import select
import socket
import struct
import time
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

PROTOCOL_VERSION = 5
MAGIC = b"KR"
HEADER = struct.Struct(">2sBBI")
MAX_FRAME = 1 << 20


class ErrorCode(enum.Enum):
    """Why a request was refused, on the wire as the value string."""

    NONE = ""
    UNKNOWN_LEASE = "unknown_lease"  # no such lease (forged, or its record was pruned)
    # The engine named this lease before making it (vLLM's scheduler hands the lease to
    # its worker with the next step): ask again shortly, within a bound (version 5).
    NOT_YET = "not_yet"
    WRONG_ENGINE = "wrong_engine"  # the lease is of another engine life (P restarted)
    LEASE_BUSY = "lease_busy"  # another attempt holds the lease
    NOT_HOLDER = "not_holder"  # the message is not from the attempt that holds the lease
    FENCE = "fence"  # the blocks changed under the lease: the copy is not valid
    READ_DENIED = "read_denied"  # blocks outside the lease, or read already
    BAD_RANGE = "bad_range"  # an ACQUIRE's first_block outside the lease
    BAD_FRAME = "bad_frame"  # malformed, oversized or out-of-order frame
    AUTH_FAILED = "auth_failed"  # hello not authenticated (wrong or missing secret)
    REFUSED = "refused"  # hello refused: version, compat, layout, transport or capacity
    UNREACHABLE = "unreachable"  # (decode side only) the relay could not be reached


class ProtocolError(ValueError):
    """A frame that cannot be understood or a HELLO that is refused; the connection is
    answered (an error Reply carrying ``code``) and closed."""

    default_code = ErrorCode.BAD_FRAME

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version (frame header or HELLO payload)."""

    default_code = ErrorCode.REFUSED


class FrameTimeout(ProtocolError):
    """A frame that was started did not complete within its bound (a stalled peer)."""


class IdleTimeout(ConnectionError):
    """No frame started within the idle bound: the connection is closed quietly."""


class Challenge(msgspec.Struct, tag="challenge"):
    engine_id: str
    nonce: bytes
    version: int = PROTOCOL_VERSION


class Hello(msgspec.Struct, tag="hello"):
    seq: int
    version: int
    compat: str  # KvGeometry.compat_hash: architecture, dtype, layers, heads, block size
    layout: str
    transport: str  # "shm" | "tcp"
    client_id: str
    nonce: bytes = b""  # D's, for P's proof of the secret in its reply
    mac: bytes = b""
    # D's KV cache dtype (KvGeometry.dtype; "" from an older D), only so that a refusal
    # can name both engines' dtypes: compat (in the mac) already covers it.
    kv_dtype: str = ""


class Acquire(msgspec.Struct, tag="acquire"):
    seq: int
    engine_id: str
    lease_id: str
    holder: str
    attempt: str
    # A partial pull: the decode engine has the lease's blocks before this one in its
    # own prefix cache. The reply's block_ids (and the fence) cover the rest only.
    first_block: int = 0


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    seq: int
    engine_id: str
    lease_id: str
    holder: str
    attempt: str


class Release(msgspec.Struct, tag="release"):
    seq: int
    engine_id: str
    lease_id: str
    holder: str
    attempt: str
    ok: bool


class Abort(msgspec.Struct, tag="abort"):
    """From D: the attempt gives the lease up (it may not be acquired yet)."""

    seq: int
    engine_id: str
    lease_id: str
    holder: str
    attempt: str


class Read(msgspec.Struct, tag="read"):
    seq: int
    engine_id: str
    lease_id: str
    holder: str
    attempt: str
    block_ids: list[int]
    # Commit once the blocks are sent: P applies RELEASE(ok) of this attempt right after
    # its last send returned (its memory is read no more) and sends the verdict, a Reply,
    # after the bytes. The fence is the one RELEASE(ok) applies, at a moment no later
    # than D's own RELEASE(ok) could (protocol version 4).
    commit: bool = False


class Reply(msgspec.Struct, tag="reply", omit_defaults=True):
    seq: int
    status: str  # "ok" | "released" | "error"  (lease.Status values)
    state: str = ""
    reason: str = ""  # release reason when the lease is released
    error: str = ""
    code: str = ""  # ErrorCode value when status is not ok
    engine_id: str = ""
    block_ids: list[int] = msgspec.field(default_factory=list)
    generations: list[int] = msgspec.field(default_factory=list)
    num_tokens: int = 0
    first_token: int = 0
    nbytes: int = 0  # raw bytes following this frame (Read)
    transport: dict[str, Any] = msgspec.field(default_factory=dict)
    # Set by the decode side's client to the relay whose connection delivered the reply
    # (any value a peer puts on the wire is overwritten); empty in the simulators.
    relay: str = ""
    mac: bytes = b""  # the reply to HELLO: P's proof of the secret (relay_proof)
    prompt_digest: bytes = b""  # the lease's prompt (prompt_digest): D checks its own


Request = Hello | Acquire | Heartbeat | Release | Abort | Read
Message = Challenge | Request | Reply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    payload = _encoder.encode(msg)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME} limit")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(payload)) + payload


def parse_header(header: bytes) -> int:
    """Check a frame header; return the payload length."""
    magic, version, _, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("not a kvrelay relay frame (bad magic)")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"relay protocol version {version} is not supported; this engine speaks "
            f"{PROTOCOL_VERSION}"
        )
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME} limit")
    return length


def decode(payload: bytes) -> Message:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed relay frame: {e}") from None


def hello_mac(secret: bytes, nonce: bytes, hello: Hello) -> bytes:
    fields = (hello.version, hello.compat, hello.layout, hello.transport, hello.client_id)
    text = nonce + hello.nonce + "|".join(str(f) for f in fields).encode()
    return hmac.new(secret, text, hashlib.sha256).digest()


def check_hello_mac(secret: bytes | None, nonce: bytes, hello: Hello) -> bool:
    if secret is None:
        return True
    return hmac.compare_digest(hello.mac, hello_mac(secret, nonce, hello))


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """Names a prompt's token ids: a lease carries its prompt's, and D refuses to decode
    (and to publish in its prefix cache) KV of a lease whose prompt is not its own."""
    return hashlib.sha256(b"kvrelay-prompt\0" + array("q", token_ids).tobytes()).digest()


def relay_proof(secret: bytes, challenge_nonce: bytes, hello: Hello, relay: str) -> bytes:
    """P's answer to D's nonce: only a holder of the secret can make it, and it is
    bound to this connection (both nonces), to this decode engine and to the address P
    advertises (``relay``, the one in its kv_transfer_params). D checks it against the
    address it dialled: a relay that forwards the handshake to a real P (a client may
    name any address in its params) proves P's address, not its own, and is refused."""
    text = (b"kvrelay-relay-proof\0" + challenge_nonce + hello.nonce
            + hello.client_id.encode() + b"\0" + relay.encode())
    return hmac.new(secret, text, hashlib.sha256).digest()


def kernel_timeouts(sock: Any, seconds: float) -> None:
    """Make ``sock`` blocking with each recv and send bounded in the kernel
    (SO_RCVTIMEO, SO_SNDTIMEO): a call that makes no progress for ``seconds`` fails
    with EAGAIN (``BlockingIOError``, an ``OSError``). Unlike ``settimeout`` this
    adds no poll(2) per call on the data path, and no thread sharing the socket
    changes it for another."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def wait_readable(sock: Any, deadline: float | None) -> bool:
    """Wait until ``sock`` has bytes (or EOF) to read; False once ``deadline`` passed.

    Waits with poll(2) instead of the socket's timeout, so the socket's own send
    bound (shared by every thread using the socket) is left alone."""
    left_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1e3) + 1)
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN | select.POLLPRI)
    except ValueError:  # closed meanwhile by another thread (fileno -1)
        raise ConnectionError("the relay connection was closed") from None
    return bool(poller.poll(left_ms))


def read_exact(sock: Any, n: int, deadline: float | None = None, what: str = "frame") -> bytes:
    """Read exactly ``n`` bytes from a socket or raise ``ConnectionError``.

    With ``deadline`` (``time.monotonic``): all ``n`` bytes must have arrived by then,
    however the peer trickles them, else ``FrameTimeout``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None and not wait_readable(sock, deadline):
            raise FrameTimeout(f"{what} not completed in time ({got} of {n} bytes arrived)")
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the relay connection")
        got += k
    return bytes(buf)


def recv_frame(
    sock: Any,
    *,
    start_by: float | None = None,
    frame_timeout: float | None = None,
    complete_by: float | None = None,
) -> Message:
    """Read one frame. Without keywords: as the socket's own timeout allows.

    ``start_by``: the frame's first byte must arrive by then (``time.monotonic``),
    else ``IdleTimeout``. Once it has arrived the whole frame must complete within
    ``frame_timeout`` seconds and by ``complete_by``, else ``FrameTimeout``: a peer
    that starts a frame and stalls (or trickles bytes) holds a connection for a
    bounded time only."""
    if start_by is None and frame_timeout is None and complete_by is None:
        length = parse_header(read_exact(sock, HEADER.size))
        return decode(read_exact(sock, length))
    if not wait_readable(sock, start_by):
        raise IdleTimeout("no frame started in time")
    end = complete_by
    if frame_timeout is not None:
        started = time.monotonic() + frame_timeout
        end = started if end is None else min(end, started)
    length = parse_header(read_exact(sock, HEADER.size, end, "frame header"))
    return decode(read_exact(sock, length, end, "frame payload"))
