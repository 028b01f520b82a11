"""The tcp transport: P streams the leased blocks' bytes; D scatters them into its blocks.

Bytes go from P's cache memory to the socket (``sendall`` on a numpy view of a run
of blocks) and from the socket into D's cache memory (``recv_into`` on a view of
the destination run): no intermediate copy, no per-block Python object.

D reads on a data connection of its own (never the control connection, so a
heartbeat is not stuck behind megabytes), taken from a per-peer pool.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvrelay.relay import protocol as P
from kvrelay.relay.transports.base import (
    PeerInfo,
    TransferState,
    TransferStatus,
    byte_view,
    injected_delay,
    runs,
)

IOV_BATCH = 64  # buffers per sendmsg/recvmsg_into (IOV_MAX is 1024)


def _views(kv_bytes: np.ndarray, block_ids: Sequence[int]) -> list[memoryview]:
    """One flat memoryview per run of consecutive blocks (no copies)."""
    return [memoryview(kv_bytes[start : start + n].reshape(-1).data).cast("B")
            for start, _, n in runs(block_ids, block_ids)]


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Consume ``n`` bytes from ``bufs[i:]``; return the index of the first unfinished one."""
    while n:
        if n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    return i


def send_blocks(sock: socket.socket, kv_bytes: np.ndarray, block_ids: Sequence[int]) -> None:
    """Scatter-gather send: up to IOV_BATCH runs of blocks per system call."""
    bufs = _views(kv_bytes, block_ids)
    i = 0
    while i < len(bufs):
        i = _advance(bufs, i, sock.sendmsg(bufs[i : i + IOV_BATCH]))


def recv_blocks(
    sock: socket.socket,
    kv_bytes: np.ndarray,
    block_ids: Sequence[int],
    cancelled: threading.Event,
) -> None:
    """Scatter receive straight into the blocks' memory, many blocks per system call."""
    bufs = _views(kv_bytes, block_ids)
    i = 0
    while i < len(bufs):
        if cancelled.is_set():
            raise ConnectionAbortedError("transfer cancelled")
        k = sock.recvmsg_into(bufs[i : i + IOV_BATCH])[0]
        if k == 0:
            raise ConnectionError("the prefill engine closed the data connection")
        i = _advance(bufs, i, k)


@dataclass
class TcpHandle:
    thread: threading.Thread | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))
    started: float = 0.0
    sock: socket.socket | None = None  # shut down by cancel() to unblock a waiting recv


# Opens an authenticated data connection to a relay (HELLO done) and returns it.
Connector = Callable[[str], socket.socket]


class TcpTransport:
    name = "tcp"

    def __init__(self, kv_cache: Any = None, connect: Connector | None = None) -> None:
        self.kv_bytes = byte_view(kv_cache) if kv_cache is not None else None
        self.connect = connect
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self.delay = injected_delay()

    def register(self, kv_cache: Any) -> dict[str, Any]:
        self.kv_bytes = byte_view(kv_cache)
        return {"block_bytes": int(self.kv_bytes.shape[1])}

    def read(
        self,
        peer: PeerInfo,
        lease_id: str,
        holder: str,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        *,
        attempt: str = "",
    ) -> TcpHandle:
        h = TcpHandle(started=time.perf_counter())
        args = (h, peer, lease_id, holder, attempt, list(remote_blocks), list(local_blocks))
        h.thread = threading.Thread(target=self._run, args=args, daemon=True)
        h.thread.start()
        return h

    def poll(self, handle: TcpHandle) -> TransferStatus:
        return handle.status

    def cancel(self, handle: TcpHandle) -> None:
        """Stop soon: the reader thread ends (and stops writing) at its next recv."""
        handle.cancelled.set()
        sock = handle.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for c in conns:
                    c.close()
            self._idle.clear()

    def _run(self, h: TcpHandle, peer: PeerInfo, lease_id: str, holder: str, attempt: str,
             remote: list[int], local: list[int]) -> None:
        sock: socket.socket | None = None
        try:
            assert self.kv_bytes is not None and self.connect is not None
            if self.delay:
                h.cancelled.wait(self.delay)
            sock = self._take(peer.relay)
            h.sock = sock
            if h.cancelled.is_set():
                raise ConnectionAbortedError("transfer cancelled")
            with self._lock:
                self._seq += 1
                seq = self._seq
            sock.sendall(P.encode(P.Read(seq, peer.engine_id, lease_id, holder, attempt, remote)))
            reply = P.recv_frame(sock)
            if not isinstance(reply, P.Reply) or reply.status != "ok":
                err = reply.error if isinstance(reply, P.Reply) else "unexpected frame"
                raise ConnectionError(f"read refused: {err} {getattr(reply, 'reason', '')}")
            if reply.nbytes != len(local) * self.kv_bytes.shape[1]:
                raise ConnectionError(
                    f"read of {reply.nbytes} bytes does not fit {len(local)} blocks"
                )
            self._recv_scattered(sock, remote, local, h.cancelled)
            h.sock = None
            self._give_back(peer.relay, sock)
            sock = None
            h.status = TransferStatus(TransferState.DONE, nbytes=reply.nbytes,
                                      seconds=time.perf_counter() - h.started)
        except (OSError, ConnectionError, P.ProtocolError, AssertionError) as e:
            h.status = TransferStatus(TransferState.FAILED, error=f"tcp transfer failed: {e}")
        finally:
            h.sock = None
            if sock is not None:
                sock.close()

    def _recv_scattered(self, sock: socket.socket, remote: list[int], local: list[int],
                        cancelled: threading.Event) -> None:
        # P sends the remote blocks in request order: local[i] receives remote[i].
        assert self.kv_bytes is not None
        recv_blocks(sock, self.kv_bytes, local, cancelled)

    def _take(self, relay: str) -> socket.socket:
        with self._lock:
            idle = self._idle.get(relay)
            if idle:
                return idle.pop()
        assert self.connect is not None
        return self.connect(relay)

    def _give_back(self, relay: str, sock: socket.socket) -> None:
        with self._lock:
            self._idle.setdefault(relay, []).append(sock)


def close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
