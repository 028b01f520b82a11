"""The decode engine's relay client: connections to prefill relays, replies into a queue.

``RelayClient`` is the production ``RelayLink`` of the receiver. It keeps one control
connection per relay (challenge, HELLO with the optional HMAC, then requests), a
reader thread per connection that puts every ``Reply`` on ``replies``, and opens
data connections for the tcp transport. The engine loop drains ``replies`` into
``Receiver.on_reply``; a send that fails drops the connection, and the receiver's
retransmission (or its give-up) takes it from there.
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
        self._conns: dict[str, tuple[socket.socket, PeerInfo]] = {}
        self._lock = threading.Lock()
        self._send_locks: dict[str, threading.Lock] = {}

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
        return self._control(relay)[1]

    def send(self, relay: str, msg: P.Request) -> None:
        try:
            sock, _ = self._control(relay)
            with self._send_locks[relay]:
                sock.sendall(P.encode(msg))
        except (RelayUnavailable, OSError):
            self._drop(relay)

    def close(self) -> None:
        with self._lock:
            relays = list(self._conns)
        for relay in relays:
            self._drop(relay)

    # -- internals -----------------------------------------------------------------
    def _control(self, relay: str) -> tuple[socket.socket, PeerInfo]:
        with self._lock:
            got = self._conns.get(relay)
            if got is not None:
                return got
            got = self.open(relay)
            self._conns[relay] = got
            self._send_locks[relay] = threading.Lock()
        threading.Thread(target=self._read_loop, args=(relay, got[0]), daemon=True).start()
        return got

    def _read_loop(self, relay: str, sock: socket.socket) -> None:
        try:
            while True:
                msg = P.recv_frame(sock)
                if isinstance(msg, P.Reply):
                    self.replies.put(msg)
        except (OSError, ConnectionError, P.ProtocolError):
            pass
        with self._lock:
            if self._conns.get(relay, (None,))[0] is sock:
                del self._conns[relay]
        sock.close()

    def _drop(self, relay: str) -> None:
        with self._lock:
            got = self._conns.pop(relay, None)
        if got is not None:
            with contextlib.suppress(OSError):
                got[0].shutdown(socket.SHUT_RDWR)
            got[0].close()
