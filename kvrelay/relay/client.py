"""The decode engine's relay client: connections to prefill relays, replies into a queue.

``RelayClient`` is the production ``RelayLink`` of the receiver. Per relay it keeps
one control connection (challenge, HELLO with the optional HMAC, then requests)
written by a sender thread from a queue, so ``send`` never blocks the engine loop,
and read by a reader thread that puts every ``Reply`` on ``replies``; it also opens
data connections for the tcp transport. The engine loop drains ``replies`` into
``Receiver.on_reply``; a send that fails drops the connection and the message, and
the receiver's retransmission (or its give-up) takes it from there.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading

from kvrelay.relay import protocol as P
from kvrelay.relay.transports.base import PeerInfo


class RelayUnavailable(ConnectionError):
    pass


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
        secret: bytes | None = None,
        connect_timeout: float = 2.0,
    ) -> None:
        self.compat = compat
        self.layout = layout
        self.transport = transport
        self.client_id = client_id
        self.secret = secret
        self.connect_timeout = connect_timeout
        self.replies: queue.Queue[P.Reply] = queue.Queue()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def open(self, relay: str) -> tuple[socket.socket, PeerInfo]:
        """A new authenticated connection to ``relay`` (control or tcp data)."""
        try:
            sock = socket.create_connection(split_address(relay), timeout=self.connect_timeout)
        except OSError as e:
            raise RelayUnavailable(f"cannot reach the prefill relay at {relay}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = P.recv_frame(sock)
            if not isinstance(challenge, P.Challenge):
                raise P.ProtocolError("the relay did not send a challenge")
            hello = P.Hello(0, P.PROTOCOL_VERSION, self.compat, self.layout, self.transport,
                            self.client_id)
            if self.secret is not None:
                hello.mac = P.hello_mac(self.secret, challenge.nonce, hello)
            sock.sendall(P.encode(hello))
            reply = P.recv_frame(sock)
            if not isinstance(reply, P.Reply) or reply.status != "ok":
                err = reply.error if isinstance(reply, P.Reply) else "unexpected frame"
                raise RelayUnavailable(f"the prefill relay at {relay} refused hello: {err}")
            sock.settimeout(None)
            return sock, PeerInfo(relay, reply.engine_id, dict(reply.transport))
        except (OSError, P.ProtocolError) as e:
            sock.close()
            raise RelayUnavailable(f"hello with the prefill relay at {relay} failed: {e}") from e
        except RelayUnavailable:
            sock.close()
            raise

    def open_data(self, relay: str) -> socket.socket:
        return self.open(relay)[0]

    # -- RelayLink -----------------------------------------------------------------
    def peer(self, relay: str) -> PeerInfo:
        """What HELLO told us about ``relay`` (connects once if it never answered)."""
        p = self._peer(relay)
        if p.info is None:
            sock, p.info = self.open(relay)
            sock.close()
        return p.info

    def send(self, relay: str, msg: P.Request) -> None:
        """Queue ``msg`` for ``relay``; never blocks the engine loop on the network.

        If the relay cannot be reached the message is dropped: the receiver
        retransmits, and gives up at its peer timeout."""
        self._peer(relay).outbox.put(msg)

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.outbox.put(None)
            if p.sock is not None:
                with contextlib.suppress(OSError):
                    p.sock.shutdown(socket.SHUT_RDWR)

    # -- internals -----------------------------------------------------------------
    def _peer(self, relay: str) -> _Peer:
        with self._lock:
            p = self._peers.get(relay)
            if p is None:
                p = self._peers[relay] = _Peer()
                threading.Thread(target=self._send_loop, args=(relay, p), daemon=True).start()
            return p

    def _send_loop(self, relay: str, p: _Peer) -> None:
        while (msg := p.outbox.get()) is not None:
            try:
                if p.sock is None:
                    sock, p.info = self.open(relay)
                    p.sock = sock
                    threading.Thread(target=self._read_loop, args=(p, sock), daemon=True).start()
                p.sock.sendall(P.encode(msg))
            except (RelayUnavailable, OSError):
                self._drop(p, p.sock)
        self._drop(p, p.sock)

    def _read_loop(self, p: _Peer, sock: socket.socket) -> None:
        try:
            while True:
                msg = P.recv_frame(sock)
                if isinstance(msg, P.Reply):
                    self.replies.put(msg)
        except (OSError, ConnectionError, P.ProtocolError):
            pass
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


class _Peer:
    """One prefill relay: a control connection, fed by one sender thread."""

    def __init__(self) -> None:
        self.outbox: queue.Queue[P.Request | None] = queue.Queue()
        self.sock: socket.socket | None = None
        self.info: PeerInfo | None = None
