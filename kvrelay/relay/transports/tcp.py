"""The tcp transport: P streams the leased blocks' bytes; D scatters them into its blocks.

Bytes go from P's cache memory to the socket (``sendall`` on a numpy view of a run
of blocks) and from the socket into D's cache memory (``recv_into`` on a view of
the destination run): no intermediate copy, no per-block Python object. A cache in
device memory (CUDA) has no host view: it is staged through pinned host buffers with
the copies overlapped with the socket (staging.py), on either side, independently
(``staging=True`` forces it for a CPU cache, for tests).

D reads on a data connection of its own (never the control connection, so a
heartbeat is not stuck behind megabytes), taken from a per-peer pool.

Every wait is bounded: a data socket waits at most ``io_timeout`` seconds for any
progress (a P frozen mid-copy fails the transfer within that bound), P's stream of
one READ must be taken within its deadline, and the reader thread turns any
exception into a FAILED status: a handle never stays PENDING because its thread
died.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from kvrelay.relay import protocol as P
from kvrelay.relay.transports.base import (
    PeerInfo,
    TransferState,
    TransferStatus,
    byte_view,
    injected_delay,
    on_device,
    runs,
)
from kvrelay.relay.transports.layout import HostCache, TensorCache
from kvrelay.relay.transports.staging import StagedBlocks

log = logging.getLogger(__name__)

IOV_BATCH = 64  # buffers per sendmsg/recvmsg_into (IOV_MAX is 1024)


# A block-major cache's (num_blocks, block_bytes) byte view, or a described cache.
Regions: TypeAlias = np.ndarray | HostCache


def _views(kv_bytes: Regions, block_ids: Sequence[int]) -> list[memoryview]:
    """One flat memoryview per contiguous range of the blocks, in stream order (no
    copies): per run of consecutive ids for a block-major cache; as the layout cuts
    them for a described one (layout.py). Each side groups its own runs."""
    if isinstance(kv_bytes, HostCache):
        return kv_bytes.views(block_ids)
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


def send_blocks(sock: socket.socket, kv_bytes: Regions, block_ids: Sequence[int],
                deadline: float | None = None) -> None:
    """Scatter-gather send: up to IOV_BATCH runs of blocks per system call.

    With ``deadline`` (``time.monotonic``) the stream must have been taken by then,
    checked between system calls (each one is bounded by the socket's own send
    timeout), else ``TimeoutError``."""
    bufs = _views(kv_bytes, block_ids)
    i = 0
    while i < len(bufs):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the peer did not take the stream in time")
        i = _advance(bufs, i, sock.sendmsg(bufs[i : i + IOV_BATCH]))


def recv_blocks(
    sock: socket.socket,
    kv_bytes: Regions,
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


class HostBlocks:
    """A cache in host memory: the socket reads and writes the blocks' own bytes
    (one view, block-major; or a described cache, layout.py)."""

    def __init__(self, kv_bytes: Regions) -> None:
        self.kv_bytes = kv_bytes
        self.block_bytes = (kv_bytes.layout.block_bytes if isinstance(kv_bytes, HostCache)
                            else int(kv_bytes.shape[1]))

    def send(self, sock: socket.socket, block_ids: Sequence[int],
             deadline: float | None = None) -> None:
        send_blocks(sock, self.kv_bytes, block_ids, deadline)

    def recv(self, sock: socket.socket, block_ids: Sequence[int],
             cancelled: threading.Event) -> None:
        recv_blocks(sock, self.kv_bytes, block_ids, cancelled)


def block_io(kv_cache: Any, staging: bool | None = None, *,
             pinned_bytes: int | None = None) -> HostBlocks | StagedBlocks:
    """How a cache's blocks meet a socket: in place in host memory, or staged (a cache
    in device memory; any cache with ``staging=True``). A described cache: in place
    for a ``HostCache``, staged for a ``TensorCache`` (layout.layer_cache makes one for
    a cache on a GPU). ``pinned_bytes``: the staging's page-locked memory (staging.py)."""
    if isinstance(kv_cache, HostCache):
        return HostBlocks(kv_cache)
    if staging is None:
        staging = isinstance(kv_cache, TensorCache) or on_device(kv_cache)
    if staging:
        return StagedBlocks(kv_cache, pinned_bytes=pinned_bytes)
    return HostBlocks(byte_view(kv_cache))


@dataclass
class TcpHandle:
    thread: threading.Thread | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))
    started: float = 0.0
    sock: socket.socket | None = None  # shut down by cancel() to unblock a waiting recv
    first_byte: float = 0.0  # P's answer to the READ arrived (perf_counter)


# Opens an authenticated data connection to a relay (HELLO done) and returns it.
Connector = Callable[[str], socket.socket]


class TcpTransport:
    name = "tcp"

    def __init__(self, kv_cache: Any = None, connect: Connector | None = None, *,
                 io_timeout: float = 30.0, max_per_relay: int = 16,
                 staging: bool | None = None, max_idle: int = 32,
                 idle_s: float = 30.0) -> None:
        """``io_timeout``: the longest a data socket waits for any progress (a reply, a
        byte of the stream, room to send); the server wires it from --lease-timeout so
        a P frozen mid-copy fails the transfer well within the lease timeout.
        ``staging``: stage through host buffers (default: for a cache on a device).
        ``max_idle``, ``idle_s``: at most that many pooled data sockets in all, each
        closed after that long unused (whichever relay asks next: a relay never named
        again keeps none for ever)."""
        if not io_timeout > 0:
            raise ValueError(f"io_timeout must be > 0, got {io_timeout}")
        self.staging = staging
        self.blocks = block_io(kv_cache, staging) if kv_cache is not None else None
        self.connect = connect
        self.io_timeout = io_timeout
        # Pooled data sockets by relay (canonical host:port), each with the time it
        # was given back; at most max_idle in all, none older than idle_s.
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}
        self._num_idle = 0
        self.max_idle, self.idle_s = max_idle, idle_s
        # At most max_per_relay transfers (so data connections) per relay at once: well
        # under the relay's per-address cap (64), however many loads D runs; the rest
        # wait their turn (cancellable), their leases heartbeated meanwhile.
        self.max_per_relay = max_per_relay
        # Per relay: its semaphore and how many transfers use it (the entry goes with
        # the last one, so relays named once leave nothing behind).
        self._slots: dict[str, tuple[threading.BoundedSemaphore, int]] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self.delay = injected_delay()
        # Called (from the reader thread) once a handle's status is final, so the
        # receiver can act at once instead of at its next poll.
        self.on_end: Callable[[TcpHandle], None] | None = None
        # Ask P to commit at the end of each READ (protocol.Read.commit): its verdict
        # comes after the bytes, and the receiver need not send RELEASE(ok) itself.
        self.commit = False

    def register(self, kv_cache: Any) -> dict[str, Any]:
        self.blocks = block_io(kv_cache, self.staging)
        return {"block_bytes": self.blocks.block_bytes}

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
                for c, _ in conns:
                    c.close()
            self._idle.clear()
            self._num_idle = 0

    def _run(self, h: TcpHandle, peer: PeerInfo, lease_id: str, holder: str, attempt: str,
             remote: list[int], local: list[int]) -> None:
        sock: socket.socket | None = None
        slot = self._enter_slot(peer.relay)
        slotted = False
        try:
            assert self.blocks is not None and self.connect is not None
            if self.delay:
                h.cancelled.wait(self.delay)
            while not (slotted := slot.acquire(timeout=0.05)):
                if h.cancelled.is_set():
                    raise ConnectionAbortedError("transfer cancelled")
            with self._lock:
                self._seq += 1
                seq = self._seq
            # A pooled socket P closed while idle fails before P saw the READ: retry
            # once on a fresh connection (a READ P did see is never sent twice).
            for fresh in (False, True):
                sock, pooled = self._take(peer.relay, fresh)
                h.sock = sock
                if h.cancelled.is_set():
                    raise ConnectionAbortedError("transfer cancelled")
                P.kernel_timeouts(sock, self.io_timeout)
                try:
                    sock.sendall(P.encode(P.Read(seq, peer.engine_id, lease_id, holder,
                                                 attempt, remote, commit=self.commit)))
                    reply = P.recv_frame(sock)
                    h.first_byte = time.perf_counter()
                    break
                except (ConnectionError, BrokenPipeError) as e:
                    if not pooled or fresh or h.cancelled.is_set():
                        raise
                    log.debug("pooled data connection to %s was closed (%s); retrying",
                              peer.relay, e)
                    sock.close()
                    sock = h.sock = None
            assert sock is not None
            if not isinstance(reply, P.Reply) or reply.status != "ok":
                err = reply.error if isinstance(reply, P.Reply) else "unexpected frame"
                raise ConnectionError(f"read refused: {err} {getattr(reply, 'reason', '')}")
            if reply.nbytes != len(local) * self.blocks.block_bytes:
                raise ConnectionError(
                    f"read of {reply.nbytes} bytes does not fit {len(local)} blocks"
                )
            self._recv_scattered(sock, remote, local, h.cancelled)
            verdict = P.recv_frame(sock) if self.commit else None
            if verdict is not None and not isinstance(verdict, P.Reply):
                raise P.ProtocolError("the commit's verdict is not a reply")
            h.sock = None
            self._give_back(peer.relay, sock)
            sock = None
            end = time.perf_counter()
            h.status = TransferStatus(TransferState.DONE, nbytes=reply.nbytes,
                                      seconds=end - h.started,
                                      first_byte=h.first_byte - h.started,
                                      ended_at=time.monotonic(), verdict=verdict)
        except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO/SO_SNDTIMEO expired
            h.status = TransferStatus(
                TransferState.FAILED,
                error=f"tcp transfer failed: no progress from the prefill engine for "
                      f"{self.io_timeout:g} s")
        except Exception as e:  # any failure ends the transfer; the handle never hangs
            h.status = TransferStatus(TransferState.FAILED, error=f"tcp transfer failed: {e!r}"
                                      if not isinstance(e, OSError | P.ProtocolError)
                                      else f"tcp transfer failed: {e}")
        finally:
            h.sock = None
            if sock is not None:
                sock.close()
            if slotted:
                slot.release()
            self._leave_slot(peer.relay)
            if h.status.state is TransferState.PENDING:  # BaseException: still never hang
                h.status = TransferStatus(TransferState.FAILED,
                                          error="tcp transfer failed: reader interrupted")
            if self.on_end is not None:
                self.on_end(h)

    def _recv_scattered(self, sock: socket.socket, remote: list[int], local: list[int],
                        cancelled: threading.Event) -> None:
        # P sends the remote blocks in request order: local[i] receives remote[i].
        assert self.blocks is not None
        self.blocks.recv(sock, local, cancelled)

    def _enter_slot(self, relay: str) -> threading.BoundedSemaphore:
        with self._lock:
            slot, users = self._slots.get(relay) or (
                threading.BoundedSemaphore(self.max_per_relay), 0)
            self._slots[relay] = (slot, users + 1)
            return slot

    def _leave_slot(self, relay: str) -> None:
        with self._lock:
            slot, users = self._slots[relay]
            if users > 1:
                self._slots[relay] = (slot, users - 1)
            else:
                del self._slots[relay]

    def _take(self, relay: str, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A data connection to ``relay`` and whether it came from the pool. Pooled
        sockets P has closed (idle timeout) or written to unasked are dropped."""
        while not fresh:
            with self._lock:
                self._evict_idle_locked(time.monotonic(), room=0)
                idle = self._idle.get(relay)
                sock = idle.pop()[0] if idle else None
                if sock is not None:
                    self._num_idle -= 1
                    if not idle:
                        del self._idle[relay]
            if sock is None:
                break
            if _still_quiet(sock):
                return sock, True
            sock.close()
        assert self.connect is not None
        return self.connect(relay), False

    def _give_back(self, relay: str, sock: socket.socket) -> None:
        with self._lock:
            self._evict_idle_locked(time.monotonic(), room=1)
            self._idle.setdefault(relay, []).append((sock, time.monotonic()))
            self._num_idle += 1

    def _evict_idle_locked(self, now: float, room: int) -> None:
        """Close pooled sockets unused for ``idle_s``, then the oldest ones until ``room``
        more fit under ``max_idle``. O(max_idle): the pool is small and bounded."""
        for relay in list(self._idle):
            conns = self._idle[relay]
            keep = [(c, t) for c, t in conns if now - t < self.idle_s]
            for c, t in conns:
                if now - t >= self.idle_s:
                    close_quietly(c)
            self._num_idle -= len(conns) - len(keep)
            if keep:
                self._idle[relay] = keep
            else:
                del self._idle[relay]
        while self._idle and self._num_idle + room > self.max_idle:
            relay = min(self._idle, key=lambda r: self._idle[r][0][1])
            conns = self._idle[relay]
            close_quietly(conns.pop(0)[0])
            self._num_idle -= 1
            if not conns:
                del self._idle[relay]


def _still_quiet(sock: socket.socket) -> bool:
    """An idle data connection has nothing to read; readable means EOF or garbage."""
    try:
        p = select.poll()
        p.register(sock, select.POLLIN | select.POLLPRI)
        return not p.poll(0)
    except (OSError, ValueError):
        return False


def close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
