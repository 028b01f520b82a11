"""The prefill engine's relay server: decode engines acquire, read and release leases here.

One thread accepts, one thread per connection serves it, one thread expires
leases at their deadlines. Every change of the lease table (and so of the block
pool it frees into) happens under ``lock``, the same lock the engine loop holds
while it schedules and applies steps: the pool is never touched by two threads
at once. Streaming a lease's bytes (the tcp transport's Read) happens outside the
lock; a read racing an expiry is caught by the fence at RELEASE (see lease.py).

A connection that sends a malformed, oversized or unauthenticated frame gets an
error reply (with an ``ErrorCode``) and is closed; its thread ends, everyone else
is unaffected.

A hostile or broken peer holds a connection slot for a bounded time only
(``RelayServerConfig``): the whole HELLO must arrive within ``handshake_timeout``
of the accept (trickled bytes do not renew it); after HELLO a frame, once its
first byte arrived, must complete within ``frame_timeout``; an authenticated
connection on which no frame starts for ``idle_timeout`` is closed (the client
reconnects when it next needs to); a reply or a READ stream the peer does not take
within ``send_timeout`` ends the connection. ``max_connections_per_address`` caps
one peer address under the global ``max_connections``. When every slot is taken
(the address's or all of them), a new connection evicts the oldest connection still
in its handshake that counts against that cap (so peers sitting in the handshake
cannot lock out a decode engine that knows the secret, even one on their own
address: a NAT, the same host); if none is in its handshake it is refused. A
refused connection is answered with an error Reply (code ``refused``) instead of
the challenge, then closed.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvrelay.relay import protocol as P
from kvrelay.relay.lease import Answer, LeaseTable, Status
from kvrelay.relay.port import Request
from kvrelay.relay.prefill import KvTransferParams, PrefillRelay, answer_reply
from kvrelay.relay.transports.staging import StagedBlocks
from kvrelay.relay.transports.tcp import HostBlocks

log = logging.getLogger(__name__)

E = P.ErrorCode
LEASE_MESSAGES = (P.Acquire, P.Heartbeat, P.Release, P.Abort)


@dataclass
class ServerStats:
    connections: int = 0
    protocol_errors: int = 0
    auth_failures: int = 0
    refused: int = 0  # connections refused at accept (caps), both kinds
    refused_per_address: int = 0  # ... because their address was at its cap
    hellos_refused: int = 0  # HELLOs refused: version, compat, layout, transport
    evicted: int = 0  # connections dropped in their handshake to make room
    frame_timeouts: int = 0  # a handshake or a started frame did not complete in time
    idle_closed: int = 0  # authenticated connections closed after idle_timeout
    not_holder: int = 0  # lease messages naming another holder than the HELLO's client_id
    reads_denied: int = 0  # READs refused (blocks outside the lease or read already)
    bytes_sent: int = 0  # tcp transport payload bytes


@dataclass
class RelayServerConfig:
    compat: str
    layout: str = "block_major"
    kv_dtype: str = ""  # KvGeometry.dtype: named in a HELLO refusal beside the decode side's
    host: str = "127.0.0.1"  # what the relay port binds (may be a wildcard: 0.0.0.0, ::)
    port: int = 0
    # The host decode engines are told to dial (kv_transfer_params' relay, and the
    # address P's HELLO proof is bound to); empty: ``host``.
    advertise_host: str = ""
    secret: bytes | None = None
    max_connections: int = 256
    max_connections_per_address: int = 64
    handshake_timeout: float = 5.0  # accept -> HELLO complete, in total
    frame_timeout: float = 5.0  # a frame's first byte -> the frame complete
    idle_timeout: float = 120.0  # no frame started on an authenticated connection
    send_timeout: float = 30.0  # a reply, or a whole READ stream, taken by the peer
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("handshake_timeout", "frame_timeout", "idle_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.max_connections_per_address <= self.max_connections:
            raise ValueError(
                f"need 0 < max_connections_per_address ({self.max_connections_per_address})"
                f" <= max_connections ({self.max_connections})"
            )


SERVER_METRIC_HELP = {
    "kvrelay_relay_connections": "Open connections on the relay port (all states).",
    "kvrelay_relay_connections_refused_total":
        "Connections refused at accept (answered with code refused), by the cap they hit.",
    "kvrelay_relay_hello_failures_total":
        "HELLOs refused: auth_failed (wrong or missing relay secret) or refused (protocol "
        "version, model/KV compat, layout or transport mismatch).",
    "kvrelay_relay_connections_cut_total":
        "Connections the relay closed: frame_timeout (HELLO or a started frame not "
        "completed in time), idle (no frame for idle_timeout), evicted (in the handshake "
        "when every slot was taken).",
    "kvrelay_relay_requests_refused_total":
        "Requests refused without effect: not_holder (holder is not the connection's "
        "HELLO client_id), read_denied (READ outside the lease's byte budget).",
}


@dataclass
class _Conn:
    address: str
    thread: threading.Thread | None = None


class RelayServer:
    def __init__(
        self,
        table: LeaseTable,
        lock: threading.Lock | threading.RLock,
        config: RelayServerConfig,
        *,
        kv_bytes: np.ndarray | None = None,
        kv_blocks: HostBlocks | StagedBlocks | None = None,
        part_blocks: Callable[[int, int], HostBlocks | StagedBlocks] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.lock = lock
        self.config = config
        # The KV cache's blocks for the tcp transport: ``kv_bytes``, a (num_blocks,
        # block_bytes) uint8 view of a cache in host memory, or ``kv_blocks``
        # (tcp.block_io: a cache in device memory is staged through host buffers).
        self.kv_blocks = kv_blocks if kv_blocks is not None else (
            HostBlocks(kv_bytes) if kv_bytes is not None else None)
        # A split lease's part (i, k) reads head slice i of k of the blocks (lease.py)
        self.part_blocks = part_blocks
        self.clock = clock
        self.stats = ServerStats()
        self.relay = PrefillRelay(table, address="", compat=config.compat, clock=clock)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        # Live connections, their count per peer address, and those still in their
        # handshake in accept order (the eviction order). Guarded by _conns_lock.
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_address: dict[str, int] = {}
        self._handshaking: OrderedDict[socket.socket, None] = OrderedDict()  # oldest first
        self._handshaking_from: dict[str, OrderedDict[socket.socket, None]] = {}
        self._conns_lock = threading.Lock()
        self._stats_lock = threading.Lock()  # counters bumped by connection threads
        self._last_warning: dict[str, float] = {}

    # -- lifecycle -------------------------------------------------------------
    @property
    def address(self) -> str:
        assert self._sock is not None, "start() the server first"
        host, port = self._sock.getsockname()[:2]
        return f"{self.config.advertise_host or host}:{port}"

    def start(self) -> RelayServer:
        sock = socket.create_server((self.config.host, self.config.port), backlog=128)
        self._sock = sock
        self.relay.address = self.address
        for target in (self._accept_loop, self._expiry_loop):
            t = threading.Thread(target=target, name=f"relay-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, close every connection, stop the threads. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        end = time.monotonic() + timeout
        for t in self._threads:  # the acceptor first: no connection is added after this
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, end - time.monotonic()))
        with self._conns_lock:
            conns = list(self._conns.items())
        for c, _ in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for _, st in conns:
            if st.thread is not None and st.thread is not threading.current_thread():
                st.thread.join(timeout=max(0.0, end - time.monotonic()))

    @property
    def open_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def samples(self) -> dict[str, dict[tuple[str, ...], float]]:
        """The relay port's own figures (name -> labels -> value); metrics.py exports
        them with the HELP texts of ``SERVER_METRIC_HELP``."""
        st = self.stats
        return {
            "kvrelay_relay_connections": {(): float(self.open_connections)},
            "kvrelay_relay_connections_refused_total": {
                ("max_connections_per_address",): float(st.refused_per_address),
                ("max_connections",): float(st.refused - st.refused_per_address),
            },
            "kvrelay_relay_hello_failures_total": {
                ("auth_failed",): float(st.auth_failures),
                ("refused",): float(st.hellos_refused),
            },
            "kvrelay_relay_connections_cut_total": {
                ("frame_timeout",): float(st.frame_timeouts),
                ("idle",): float(st.idle_closed),
                ("evicted",): float(st.evicted),
            },
            "kvrelay_relay_requests_refused_total": {
                ("not_holder",): float(st.not_holder),
                ("read_denied",): float(st.reads_denied),
            },
        }

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
                conn, addr = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # EMFILE and friends: do not spin, do not die
                continue
            address = str(addr[0])
            if self._stop.is_set():
                conn.close()
                return
            refusal = self._admit(conn, address)
            if refusal:
                self._refuse(conn, address, refusal)
                continue
            self.stats.connections += 1
            t = threading.Thread(target=self._serve, args=(conn, address), daemon=True,
                                 name=f"relay-conn-{address}")
            with self._conns_lock:
                st = self._conns.get(conn)
                if st is not None:
                    st.thread = t
            try:
                t.start()
            except RuntimeError as e:  # no room for a thread: this connection only
                with self._conns_lock:
                    self._forget_locked(conn)
                self._refuse(conn, address, f"the relay cannot serve a connection now: {e}")

    def _admit(self, conn: socket.socket, address: str) -> str:
        """Take a slot for ``conn``; '' when admitted, else why it is refused. A full cap
        (the address's, then the global one) first evicts the oldest connection still in
        its handshake that counts against it: peers sitting in the handshake never lock
        out a decode engine that knows the secret, not even from their own address."""
        cfg = self.config
        victims: list[socket.socket] = []
        with self._conns_lock:
            if self._per_address.get(address, 0) >= cfg.max_connections_per_address:
                mine = self._handshaking_from.get(address)
                if not mine:
                    self.stats.refused_per_address += 1
                    return (f"too many connections from {address} (max_connections_per_"
                            f"address={cfg.max_connections_per_address})")
                victims.append(next(iter(mine)))
                self._forget_locked(victims[-1])
            if len(self._conns) >= cfg.max_connections:
                if not self._handshaking:
                    return f"the relay is at max_connections={cfg.max_connections}"
                victims.append(next(iter(self._handshaking)))
                self._forget_locked(victims[-1])
            self._conns[conn] = _Conn(address)
            self._per_address[address] = self._per_address.get(address, 0) + 1
            self._handshaking[conn] = None
            self._handshaking_from.setdefault(address, OrderedDict())[conn] = None
        for victim in victims:
            self.stats.evicted += 1
            with contextlib.suppress(OSError):  # its thread sees EOF and ends
                victim.shutdown(socket.SHUT_RDWR)
        return ""

    def _handshake_done_locked(self, conn: socket.socket, address: str) -> None:
        self._handshaking.pop(conn, None)
        mine = self._handshaking_from.get(address)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._handshaking_from[address]

    def _forget_locked(self, conn: socket.socket) -> None:
        st = self._conns.pop(conn, None)
        if st is None:
            return
        self._handshake_done_locked(conn, st.address)
        n = self._per_address[st.address] - 1
        if n:
            self._per_address[st.address] = n
        else:
            del self._per_address[st.address]

    def _refuse(self, conn: socket.socket, address: str, why: str) -> None:
        self.stats.refused += 1
        self._warn(f"refused:{address}", "relay: refused a connection from %s: %s", address, why)
        try:
            conn.setblocking(False)  # a fresh socket's send buffer takes one small frame
            conn.send(P.encode(P.Reply(0, "error", error=why, code=E.REFUSED.value)))
        except OSError:
            pass
        finally:
            conn.close()

    def _expiry_loop(self) -> None:
        while not self._stop.is_set():
            nxt: float | None = None
            try:
                with self.lock:
                    self.table.expire(self.clock())
                    nxt = self.table.next_deadline()
            except Exception:  # a bug must not stop every later expiry (leases would leak)
                log.exception("lease expiry failed; retrying in 1 s")
            wait = 1.0 if nxt is None else max(0.0, min(1.0, nxt - self.clock()))
            self._wake.wait(wait)
            self._wake.clear()

    def _serve(self, conn: socket.socket, address: str) -> None:
        cfg = self.config
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Bounds every send call; reads wait with poll(2) against their own deadlines.
            P.kernel_timeouts(conn, cfg.send_timeout)
            hello = self._handshake(conn, address)
            while not self._stop.is_set():
                msg = P.recv_frame(conn, start_by=time.monotonic() + cfg.idle_timeout,
                                   frame_timeout=cfg.frame_timeout)
                self._dispatch(conn, msg, hello.client_id)
        except P.IdleTimeout:
            self._bump("idle_closed")
        except P.ProtocolError as e:
            self._bump("protocol_errors")
            if isinstance(e, P.FrameTimeout):
                self._bump("frame_timeouts")
            elif e.code is E.REFUSED:
                self._bump("hellos_refused")
            self._reply_quietly(conn, P.Reply(0, "error", error=str(e), code=e.code.value))
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug serving one peer must not stop the others
            log.exception("relay connection from %s failed", address)
        finally:
            with self._conns_lock:
                self._forget_locked(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, address: str) -> P.Hello:
        cfg = self.config
        deadline = time.monotonic() + cfg.handshake_timeout
        nonce = secrets.token_bytes(16)
        conn.sendall(P.encode(P.Challenge(self.table.engine_id, nonce)))
        try:
            hello = P.recv_frame(conn, start_by=deadline, complete_by=deadline)
        except P.IdleTimeout:
            raise P.FrameTimeout(f"no hello within {cfg.handshake_timeout:g} s") from None
        except P.FrameTimeout:
            raise P.FrameTimeout(f"hello not completed within {cfg.handshake_timeout:g} s"
                                 ) from None
        if not isinstance(hello, P.Hello):
            raise P.ProtocolError("the first frame must be hello")
        if hello.version != P.PROTOCOL_VERSION:
            raise P.VersionMismatch(
                f"hello speaks relay protocol version {hello.version}; this prefill engine "
                f"speaks {P.PROTOCOL_VERSION}"
            )
        if not P.check_hello_mac(cfg.secret, nonce, hello):
            self._bump("auth_failures")
            self._warn(f"auth:{address}", "relay: hello from %s (client_id %r) failed "
                       "authentication: wrong or missing relay secret", address,
                       hello.client_id)
            raise P.ProtocolError("hello is not authenticated: wrong or missing relay secret",
                                  E.AUTH_FAILED)
        if not hello.client_id:
            # every lease message must name its connection's client id as holder; an
            # empty one would read as the in-process proxy's (no holder)
            raise P.ProtocolError("hello names no client_id (the decode engine's id)",
                                  E.REFUSED)
        if hello.compat != cfg.compat and hello.kv_dtype and cfg.kv_dtype and (
                hello.kv_dtype != cfg.kv_dtype):
            raise P.ProtocolError(
                f"KV cache dtype mismatch: this prefill engine's KV cache is {cfg.kv_dtype}, "
                f"the decode engine's is {hello.kv_dtype[:32]}; start both with the same "
                f"--kv-cache-dtype (compat {cfg.compat} vs {hello.compat})",
                E.REFUSED,
            )
        if hello.compat != cfg.compat or hello.layout != cfg.layout:
            raise P.ProtocolError(
                f"model/KV mismatch: this prefill engine has compat {cfg.compat} layout "
                f"{cfg.layout}, the decode engine has {hello.compat} {hello.layout}",
                E.REFUSED,
            )
        if hello.transport not in cfg.transports:
            raise P.ProtocolError(
                f"transport {hello.transport!r} is not offered; offered: {sorted(cfg.transports)}",
                E.REFUSED,
            )
        proof = (P.relay_proof(cfg.secret, nonce, hello, self.relay.address)
                 if cfg.secret is not None else b"")
        with self._conns_lock:  # before the answer: the peer may dial again at once
            self._handshake_done_locked(conn, address)
        conn.sendall(P.encode(P.Reply(hello.seq, "ok", engine_id=self.table.engine_id,
                                      transport=cfg.transports[hello.transport], mac=proof)))
        return hello

    # -- requests --------------------------------------------------------------
    def _dispatch(self, conn: socket.socket, msg: P.Message, client_id: str) -> None:
        if not isinstance(msg, (*LEASE_MESSAGES, P.Read)):
            raise P.ProtocolError(f"unexpected {type(msg).__name__.lower()} frame after hello")
        if msg.holder != client_id:
            # The holder is bound to the connection's HELLO: nothing is applied.
            self._bump("not_holder")
            conn.sendall(P.encode(P.Reply(
                msg.seq, "error", code=E.NOT_HOLDER.value,
                error=f"holder {msg.holder!r} is not this connection's client {client_id!r}")))
            return
        if isinstance(msg, P.Read):
            self._serve_read(conn, msg)
            return
        with self.lock:
            reply = self.relay.handle(msg, self.clock())
        self._wake.set()  # a renewed or released lease moves the next deadline
        conn.sendall(P.encode(reply))

    def _serve_read(self, conn: socket.socket, msg: P.Read) -> None:
        if self.kv_blocks is None:
            ans = Answer(Status.ERROR, error="this relay does not serve tcp reads",
                         code=P.ErrorCode.READ_DENIED)
        else:
            with self.lock:
                ans = self.table.read_grant(msg.engine_id, msg.lease_id, msg.holder,
                                            msg.attempt, msg.block_ids)
        if not ans.ok:
            if ans.code is E.READ_DENIED:
                self._bump("reads_denied")
            conn.sendall(P.encode(answer_reply(msg.seq, ans)))
            return
        blocks = self.kv_blocks
        part = ans.lease.part if ans.lease is not None else None
        if part is not None:
            try:
                if self.part_blocks is None:
                    raise ValueError("this relay serves whole leases only")
                blocks = self.part_blocks(*part)
            except ValueError as e:
                self._bump("reads_denied")
                conn.sendall(P.encode(P.Reply(msg.seq, "error", code=E.READ_DENIED.value,
                                              error=f"lease {msg.lease_id}: {e}")))
                return
        assert blocks is not None
        nbytes = len(msg.block_ids) * blocks.block_bytes
        conn.sendall(P.encode(P.Reply(msg.seq, "ok", nbytes=nbytes)))
        # The stream must be taken within send_timeout (checked between system calls,
        # each bounded by it too): a peer that asks and does not read cannot pin this
        # thread (and its slot) for longer.
        blocks.send(conn, msg.block_ids, deadline=time.monotonic() + self.config.send_timeout)
        self._bump("bytes_sent", nbytes)
        if msg.commit:
            # Every byte has left P's blocks: the verdict RELEASE(ok) would get now.
            release = P.Release(msg.seq, msg.engine_id, msg.lease_id, msg.holder,
                                msg.attempt, ok=True)
            with self.lock:
                verdict = self.relay.handle(release, self.clock())
            self._wake.set()
            conn.sendall(P.encode(verdict))

    def _bump(self, counter: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, counter, getattr(self.stats, counter) + n)

    def _reply_quietly(self, conn: socket.socket, reply: P.Reply) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(P.encode(reply))

    def _warn(self, key: str, fmt: str, *args: Any) -> None:
        """log.warning, at most once per 10 s per key (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._last_warning.get(key, -1e9) >= 10.0:
            self._last_warning[key] = now
            if len(self._last_warning) > 4096:
                self._last_warning.clear()
            log.warning(fmt, *args)
