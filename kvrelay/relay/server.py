"""The prefill engine's relay server: decode engines acquire, read and release leases here.

One thread accepts, one thread per connection serves it, one thread expires
leases at their deadlines. Every change of the lease table (and so of the block
pool it frees into) happens under ``lock``, the same lock the engine loop holds
while it schedules and applies steps: the pool is never touched by two threads
at once. Streaming a lease's bytes (the tcp transport's Read) happens outside the
lock; a read racing an expiry is caught by the fence at RELEASE (see lease.py).

A connection that sends a malformed, oversized or unauthenticated frame gets an
error reply and is closed; its thread ends, everyone else is unaffected.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvrelay.core.request import Request
from kvrelay.relay import protocol as P
from kvrelay.relay.lease import Answer, LeaseTable, Status
from kvrelay.relay.prefill import KvTransferParams, PrefillRelay, answer_reply
from kvrelay.relay.transports.tcp import send_blocks

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0


@dataclass
class ServerStats:
    connections: int = 0
    protocol_errors: int = 0
    auth_failures: int = 0
    bytes_sent: int = 0  # tcp transport payload bytes


@dataclass
class RelayServerConfig:
    compat: str
    layout: str = "block_major"
    host: str = "127.0.0.1"
    port: int = 0
    secret: bytes | None = None
    max_connections: int = 256
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)


class RelayServer:
    def __init__(
        self,
        table: LeaseTable,
        lock: threading.Lock | threading.RLock,
        config: RelayServerConfig,
        *,
        kv_bytes: np.ndarray | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.lock = lock
        self.config = config
        # (num_blocks, block_bytes) uint8 view of the KV cache, for the tcp transport.
        self.kv_bytes = kv_bytes
        self.clock = clock
        self.stats = ServerStats()
        self.relay = PrefillRelay(table, address="", compat=config.compat, clock=clock)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------
    @property
    def address(self) -> str:
        assert self._sock is not None, "start() the server first"
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> RelayServer:
        sock = socket.create_server((self.config.host, self.config.port))
        self._sock = sock
        self.relay.address = self.address
        for target in (self._accept_loop, self._expiry_loop):
            t = threading.Thread(target=target, name=f"relay-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._conns_lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=2.0)

    # -- the engine's hook -----------------------------------------------------
    def kv_handoff(self, req: Request) -> None:
        """Engine ``kv_handoff``: the finished request's blocks become a lease.

        Called by the engine with ``lock`` held (inside its step).
        """
        self.relay.kv_handoff(req)
        self._wake.set()

    @property
    def kv_params(self) -> dict[str, KvTransferParams]:
        return self.relay.kv_params

    # -- threads ---------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._conns_lock:
                if len(self._conns) >= self.config.max_connections:
                    conn.close()
                    continue
                self._conns.add(conn)
            self.stats.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _expiry_loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self.table.expire(self.clock())
                nxt = self.table.next_deadline()
            wait = 1.0 if nxt is None else max(0.0, min(1.0, nxt - self.clock()))
            self._wake.wait(wait)
            self._wake.clear()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self._handshake(conn):
                conn.settimeout(None)
                while not self._stop.is_set():
                    msg = P.recv_frame(conn)
                    self._dispatch(conn, msg)
        except P.ProtocolError as e:
            self.stats.protocol_errors += 1
            self._reply_quietly(conn, P.Reply(0, "error", error=str(e)))
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug serving one peer must not stop the others
            log.exception("relay connection failed")
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = secrets.token_bytes(16)
        conn.sendall(P.encode(P.Challenge(self.table.engine_id, nonce)))
        hello = P.recv_frame(conn)
        if not isinstance(hello, P.Hello):
            raise P.ProtocolError("the first frame must be hello")
        cfg = self.config
        if not P.check_hello_mac(cfg.secret, nonce, hello):
            self.stats.auth_failures += 1
            raise P.ProtocolError("hello is not authenticated: wrong or missing relay secret")
        if hello.compat != cfg.compat or hello.layout != cfg.layout:
            raise P.ProtocolError(
                f"model/KV mismatch: this prefill engine has compat {cfg.compat} layout "
                f"{cfg.layout}, the decode engine has {hello.compat} {hello.layout}"
            )
        if hello.transport not in cfg.transports:
            raise P.ProtocolError(
                f"transport {hello.transport!r} is not offered; offered: {sorted(cfg.transports)}"
            )
        conn.sendall(P.encode(P.Reply(hello.seq, "ok", engine_id=self.table.engine_id,
                                      transport=cfg.transports[hello.transport])))
        return True

    # -- requests --------------------------------------------------------------
    def _dispatch(self, conn: socket.socket, msg: P.Message) -> None:
        if isinstance(msg, P.Read):
            self._serve_read(conn, msg)
            return
        if not isinstance(msg, P.Acquire | P.Heartbeat | P.Release | P.Abort):
            self.stats.protocol_errors += 1
        with self.lock:
            reply = self.relay.handle(msg, self.clock())  # type: ignore[arg-type]
        self._wake.set()  # a renewed or released lease moves the next deadline
        conn.sendall(P.encode(reply))

    def _serve_read(self, conn: socket.socket, msg: P.Read) -> None:
        if self.kv_bytes is None:
            ans = Answer(Status.ERROR, error="this relay does not serve tcp reads",
                         code=P.ErrorCode.READ_DENIED)
        else:
            with self.lock:
                ans = self.table.read_grant(msg.engine_id, msg.lease_id, msg.holder,
                                            msg.attempt, msg.block_ids)
        if not ans.ok:
            conn.sendall(P.encode(answer_reply(msg.seq, ans)))
            return
        assert self.kv_bytes is not None
        nbytes = len(msg.block_ids) * self.kv_bytes.shape[1]
        conn.sendall(P.encode(P.Reply(msg.seq, "ok", nbytes=nbytes)))
        send_blocks(conn, self.kv_bytes, msg.block_ids)
        self.stats.bytes_sent += nbytes

    def _reply_quietly(self, conn: socket.socket, reply: P.Reply) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(P.encode(reply))
