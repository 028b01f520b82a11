"""The decode engine's relay client: connections to prefill relays, replies into a queue.

``RelayClient`` is the production ``RelayLink`` of the receiver. Per relay it keeps
one control connection (challenge, HELLO with the optional HMAC, then requests)
written by a sender thread from a queue, so ``send`` never blocks the engine loop,
and read by a reader thread that puts every ``Reply`` on ``replies``; it also opens
data connections for the tcp transport. The engine loop drains ``replies`` into
``Receiver.on_reply``.

A message that cannot be delivered because no connection could be opened is
answered at once with a synthetic error ``Reply`` for its ``seq``, whose ``code``
says why (``auth_failed``: P refused our secret; ``refused``: P refused the HELLO or
had no room; ``unreachable``: no connection or no answer), so the receiver never
waits its whole timeout for a peer that said no. A send that fails on an open
connection drops the connection and the message; the receiver's retransmission
(or its give-up) takes it from there.

Bounds: opening a connection (connect, challenge, HELLO and its answer) takes at
most ``connect_timeout`` in total; a started reply frame must complete, and a send
make progress, within ``io_timeout``. After a failure to open a connection, the
messages of the next ``retry_after_s`` get the same answer without a new dial (a
refusing or unreachable relay is not hammered, and messages do not queue behind
connect timeouts). A relay's sender thread (and its connection) ends after
``idle_s`` without a message to send; the next ``send`` starts a new one. At most
``max_relays`` relays have a sender at once (params name any relay a client likes):
a new one retires the least recently used.

Supervision: any exception while sending one message fails that message only (it is
answered, the connection is dropped and dialled again for the next one); a sender
that ends for any reason unregisters its peer and answers what was still queued; a
thread that cannot start fails its message, leaving no peer behind. ``send`` never
raises into the engine loop.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import queue
import secrets
import socket
import threading
import time
from collections import OrderedDict

from kvrelay.relay import protocol as P
from kvrelay.relay.transports.base import PeerInfo

log = logging.getLogger(__name__)


class RelayUnavailable(ConnectionError):
    """No usable connection to a relay; ``code`` says why (an ``ErrorCode``)."""

    def __init__(self, message: str, code: P.ErrorCode = P.ErrorCode.UNREACHABLE) -> None:
        super().__init__(message)
        self.code = code


def split_address(relay: str) -> tuple[str, int]:
    host, _, port = relay.rpartition(":")
    return host, int(port)


class RelayClient:
    def __init__(
        self,
        *,
        compat: str,
        transport: str,
        client_id: str,
        layout: str = "block_major",
        kv_dtype: str = "",
        secret: bytes | None = None,
        connect_timeout: float = 2.0,
        io_timeout: float = 30.0,
        idle_s: float = 60.0,
        retry_after_s: float = 1.0,
        max_relays: int = 64,
    ) -> None:
        self.compat = compat
        self.layout = layout
        self.kv_dtype = kv_dtype
        self.transport = transport
        self.client_id = client_id
        self.secret = secret
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.idle_s = idle_s
        self.retry_after_s = retry_after_s
        if max_relays < 1:
            raise ValueError(f"max_relays must be >= 1, got {max_relays}")
        self.max_relays = max_relays
        self.replies: queue.Queue[P.Reply] = queue.Queue()
        # By relay (host:port, canonical: see remote.canonical_relay), least recently
        # used first; at most max_relays, so at most 2 * max_relays threads.
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, relay: str) -> tuple[socket.socket, PeerInfo]:
        """A new authenticated connection to ``relay`` (control or tcp data).

        Raises ``RelayUnavailable`` (with its ``code``) within ``connect_timeout``."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            sock = socket.create_connection(split_address(relay), timeout=self.connect_timeout)
        except (OSError, ValueError) as e:
            raise RelayUnavailable(f"cannot reach the prefill relay at {relay}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = self._recv(sock, deadline)
            if isinstance(challenge, P.Reply) and challenge.status == "error":
                raise RelayUnavailable(  # refused at accept (no room), before any HELLO
                    f"the prefill relay at {relay} refused the connection: {challenge.error}",
                    _code(challenge.code, P.ErrorCode.REFUSED))
            if not isinstance(challenge, P.Challenge):
                raise P.ProtocolError("the relay did not send a challenge")
            hello = P.Hello(0, P.PROTOCOL_VERSION, self.compat, self.layout, self.transport,
                            self.client_id, kv_dtype=self.kv_dtype)
            if self.secret is not None:
                hello.nonce = secrets.token_bytes(16)
                hello.mac = P.hello_mac(self.secret, challenge.nonce, hello)
            sock.sendall(P.encode(hello))
            reply = self._recv(sock, deadline)
            if not isinstance(reply, P.Reply) or reply.status != "ok":
                err = reply.error if isinstance(reply, P.Reply) else "unexpected frame"
                code = reply.code if isinstance(reply, P.Reply) else ""
                raise RelayUnavailable(f"the prefill relay at {relay} refused hello: {err}",
                                       _code(code, P.ErrorCode.REFUSED))
            if self.secret is not None and not hmac.compare_digest(
                    reply.mac, P.relay_proof(self.secret, challenge.nonce, hello, relay)):
                log.warning("relay %s did not prove the relay secret: not a prefill engine "
                            "of this cluster", relay)
                raise RelayUnavailable(f"the prefill relay at {relay} did not prove the relay "
                                       "secret", P.ErrorCode.AUTH_FAILED)
            P.kernel_timeouts(sock, self.io_timeout)  # bounds sends; reads wait with poll
            return sock, PeerInfo(relay, reply.engine_id, dict(reply.transport))
        except RelayUnavailable:
            sock.close()
            raise
        except (OSError, P.ProtocolError, P.IdleTimeout) as e:
            sock.close()
            why = e.code if isinstance(e, P.VersionMismatch) else P.ErrorCode.UNREACHABLE
            raise RelayUnavailable(f"hello with the prefill relay at {relay} failed: {e}",
                                   why) from e

    @staticmethod
    def _recv(sock: socket.socket, deadline: float) -> P.Message:
        try:
            return P.recv_frame(sock, start_by=deadline, complete_by=deadline)
        except P.IdleTimeout:
            raise P.FrameTimeout("the prefill relay did not answer in time") from None

    def open_data(self, relay: str) -> socket.socket:
        return self.open(relay)[0]

    # -- RelayLink -----------------------------------------------------------------
    def peer(self, relay: str) -> PeerInfo:
        """What HELLO told us about ``relay`` (connects once if it never answered)."""
        with self._lock:
            p = self._peers.get(relay)
            info = p.info if p is not None else None
        if info is None:
            sock, info = self.open(relay)
            sock.close()
            if p is not None:
                p.info = info
        return info

    def trusted(self, relay: str) -> bool:
        """May KV pulled from ``relay`` be shared with other requests (the prefix cache)?
        With a secret every relay we talk to has proved it; without one, only a relay on
        this host: the params name any address a client likes."""
        return self.secret is not None or is_local(relay)

    def send(self, relay: str, msg: P.Request) -> None:
        """Queue ``msg`` for ``relay``; never blocks the engine loop on the network, and
        never raises: a message that cannot even be queued (no thread could start for
        it) is answered at once like one that could not be delivered.

        If no connection can be opened, a synthetic error reply for ``msg.seq`` (code
        ``auth_failed``, ``refused`` or ``unreachable``) is put on ``replies``."""
        with self._lock:  # under the lock: an idle sender cannot retire in between
            p = self._peers.get(relay)
            if p is None:
                p = self._start_peer_locked(relay)
            else:
                self._peers.move_to_end(relay)
            if p is not None:
                p.outbox.put(msg)
                return
        self._answer(msg, relay, f"no sender for the prefill relay at {relay}: no thread "
                     "could be started", P.ErrorCode.UNREACHABLE)

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.outbox.put(None)
            sock = p.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    @property
    def sender_threads(self) -> int:
        with self._lock:
            return len(self._peers)

    # -- internals -----------------------------------------------------------------
    def _start_peer_locked(self, relay: str) -> _Peer | None:
        """A peer for ``relay`` with its sender thread running, registered only once the
        thread has started (a peer without a thread would queue messages for ever); None
        when no thread can start. At ``max_relays`` the least recently used peer is
        retired first, preferring one without a connection (a dead or refusing relay):
        its thread sends what it has queued, then ends."""
        if len(self._peers) >= self.max_relays:
            victim = next((k for k, q in self._peers.items() if q.sock is None),
                          next(iter(self._peers)))
            self._peers.pop(victim).outbox.put(None)
        p = _Peer()
        p.thread = threading.Thread(target=self._send_loop, args=(relay, p), daemon=True,
                                    name=f"relay-send-{relay}")
        try:
            p.thread.start()
        except RuntimeError as e:
            log.warning("relay %s: cannot start a sender thread: %s", relay, e)
            return None
        self._peers[relay] = p
        return p

    def _send_loop(self, relay: str, p: _Peer) -> None:
        """Supervised: whatever fails, fails only the message being sent (and drops the
        connection); whatever ends the thread, its peer is unregistered and every message
        still queued for it is answered, so the next ``send`` starts afresh."""
        try:
            while (msg := self._next(relay, p)) is not None:
                try:
                    self._deliver(relay, p, msg)
                except Exception as e:  # a bug: fail this message, rebuild the connection
                    log.exception("relay %s: sending seq %d failed", relay, msg.seq)
                    self._drop(p, p.sock)
                    self._answer(msg, relay, f"sending to the prefill relay at {relay} "
                                 f"failed: {e!r}", P.ErrorCode.UNREACHABLE)
        finally:
            self._retire(relay, p)

    def _next(self, relay: str, p: _Peer) -> P.Request | None:
        """The next message to send; None when told to stop or idle for ``idle_s``."""
        while True:
            try:
                return p.outbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # retire here: no send() can queue behind our back
                    if p.outbox.empty():
                        if self._peers.get(relay) is p:
                            del self._peers[relay]
                        return None

    def _retire(self, relay: str, p: _Peer) -> None:
        with self._lock:  # no send() can reach p after this
            if self._peers.get(relay) is p:
                del self._peers[relay]
        self._drop(p, p.sock)
        while True:
            try:
                msg = p.outbox.get_nowait()
            except queue.Empty:
                return
            if msg is not None:
                self._answer(msg, relay, f"the sender for the prefill relay at {relay} "
                             "stopped", P.ErrorCode.UNREACHABLE)

    def _deliver(self, relay: str, p: _Peer, msg: P.Request) -> None:
        try:
            frame = P.encode(msg)
        except P.ProtocolError as e:  # e.g. over MAX_FRAME: this message can never go
            self._answer(msg, relay, f"cannot send to the prefill relay at {relay}: {e}",
                         P.ErrorCode.BAD_FRAME)
            return
        try:
            sock = self._connection(relay, p)
        except RelayUnavailable as e:
            # Tell the receiver at once: not delivered, and why.
            self._answer(msg, relay, str(e), e.code)
            return
        try:
            sock.sendall(frame)  # ``sock``, not ``p.sock``: the reader may drop it anytime
        except OSError:
            self._drop(p, sock)  # the message is lost: the receiver retransmits

    def _connection(self, relay: str, p: _Peer) -> socket.socket:
        """The peer's open control connection, dialled (and its reader started) if none;
        raises ``RelayUnavailable``."""
        sock = p.sock
        if sock is not None:
            return sock
        if p.refusal is not None and time.monotonic() < p.retry_at:
            raise p.refusal  # it just said no: do not redial per message
        try:
            sock, p.info = self.open(relay)
        except RelayUnavailable as e:
            if p.refusal is None or p.refusal.code is not e.code:
                log.warning("relay %s: %s (code %s)", relay, e, e.code.value)
            p.refusal, p.retry_at = e, time.monotonic() + self.retry_after_s
            raise
        p.sock, p.refusal = sock, None
        try:
            threading.Thread(target=self._read_loop, args=(relay, p, sock), daemon=True,
                             name=f"relay-read-{relay}").start()
        except RuntimeError as e:  # a connection nobody reads is of no use
            self._drop(p, sock)
            raise RelayUnavailable(f"cannot read from the prefill relay at {relay}: {e}") from e
        return sock

    def _answer(self, msg: P.Request, relay: str, error: str, code: P.ErrorCode) -> None:
        self.replies.put(P.Reply(msg.seq, "error", error=error, code=code.value, relay=relay))

    def _read_loop(self, relay: str, p: _Peer, sock: socket.socket) -> None:
        try:
            while True:
                msg = P.recv_frame(sock, frame_timeout=self.io_timeout)
                if isinstance(msg, P.Reply):
                    # Stamped with the connection it came from, whatever the peer sent:
                    # the receiver takes a reply only from the relay its load talks to.
                    msg.relay = relay
                    self.replies.put(msg)
        except (OSError, ConnectionError, P.ProtocolError):
            pass
        except Exception:  # a bug: this connection ends, the sender dials a new one
            log.exception("relay %s: reading replies failed", relay)
        finally:
            self._drop(p, sock)

    @staticmethod
    def _drop(p: _Peer, sock: socket.socket | None) -> None:
        if sock is None:
            return
        if p.sock is sock:
            p.sock = None
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _code(value: str, default: P.ErrorCode) -> P.ErrorCode:
    try:
        code = P.ErrorCode(value)
    except ValueError:
        return default
    return default if code is P.ErrorCode.NONE else code


class _Peer:
    """One prefill relay: a control connection, fed by one sender thread."""

    def __init__(self) -> None:
        self.outbox: queue.Queue[P.Request | None] = queue.Queue()
        self.sock: socket.socket | None = None
        self.info: PeerInfo | None = None
        self.thread: threading.Thread | None = None
        # The last failure to open a connection, answered for every message until
        # retry_at without dialling again (a refusing or dead relay is not hammered).
        self.refusal: RelayUnavailable | None = None
        self.retry_at = 0.0


def is_local(relay: str) -> bool:
    """Is ``relay`` (host:port) on this host?"""
    host = relay.rpartition(":")[0].strip("[]")
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
