"""A KV cache in device memory over tcp: staged through host buffers, copies overlapped
with the socket.

A socket can only read and write host memory, and a CUDA tensor has no host view (the
decode engine once failed to start on ``.numpy()`` of a CUDA cache). So a READ's blocks
travel in chunks of whole blocks through two host staging buffers (page-locked on CUDA,
so the copies are real DMA and asynchronous):

- P (``send``): while chunk i is sent from one buffer, chunk i+1 is copied device ->
  host into the other on a side stream;
- D (``recv``): while chunk i+1 is received into one buffer, chunk i is copied host ->
  device out of the other.

Within a chunk, each run of consecutive block ids is one copy. The copies sit behind
``Copier``: ``CudaCopier`` (a side stream and events) or ``HostCopier`` (synchronous,
for a CPU cache: the same code runs in tests on CPU tensors with ``staging=True``).

Waits: socket waits are bounded by the socket's kernel timeouts (``io_timeout``) and
the send deadline, as in tcp.py; a device copy is bounded by the copy engine, not by a
peer. ``recv`` returns or raises only once no copy it started can still write into the
cache (its ``finally`` waits for them): a handle that polls DONE or FAILED never writes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvrelay.relay.transports.base import runs

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # per staging buffer; two per transfer in flight


class Copier(Protocol):
    """Copies between the cache and a staging buffer; ``record`` marks the copies issued
    so far, ``wait`` returns once the copies before a mark are done."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> Any: ...

    def wait(self, mark: Any) -> None: ...


class HostCopier:
    """A cache in host memory: copies are synchronous, so every mark is already done."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        return None

    def wait(self, mark: Any) -> None:
        return None


class CudaCopier:
    """Asynchronous copies on a side stream of the cache's device; a mark is an event."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, mark: Any) -> None:
        if mark is not None:
            mark.synchronize()


def cache_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_bytes) uint8 view of a block-major cache, on its own device."""
    if not (isinstance(kv_cache, torch.Tensor) and kv_cache.is_contiguous()):
        raise TypeError("the KV cache must be a contiguous block-major tensor")
    return kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], -1)


def chunks(block_ids: Sequence[int], per_chunk: int) -> list[list[tuple[int, int, int]]]:
    """The READ's blocks in order, cut into chunks of at most ``per_chunk`` blocks; each
    chunk as runs ``(cache_start, buffer_start, count)`` of consecutive cache ids."""
    ids = list(block_ids)
    return [runs(ids[i : i + per_chunk], range(min(per_chunk, len(ids) - i)))
            for i in range(0, len(ids), per_chunk)]


class StagedBlocks:
    """The tcp transport's view of a cache it cannot hand to a socket directly."""

    def __init__(self, kv_cache: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES,
                 copier: Copier | None = None) -> None:
        self.blocks = cache_bytes(kv_cache)
        self.block_bytes = int(self.blocks.shape[1])
        self.per_chunk = max(1, chunk_bytes // self.block_bytes)
        self.on_cuda = self.blocks.device.type == "cuda"
        self.copier: Copier = copier or (CudaCopier(self.blocks.device) if self.on_cuda
                                         else HostCopier())
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []  # reused buffer pairs
        self.pinned = True  # until the allocator refuses
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _buffers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Page-locked allocation costs milliseconds: pairs are kept and reused (at most
        # one per transfer running at once: max_per_relay per relay on D).
        with self._lock:
            pair = self._free.pop() if self._free else None
        if pair is None:
            pair = (self._buffer(), self._buffer())
        try:
            yield pair
        finally:
            with self._lock:
                self._free.append(pair)

    def _buffer(self) -> torch.Tensor:
        shape = (self.per_chunk, self.block_bytes)
        if self.on_cuda and self.pinned:
            try:
                return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # a sandbox that refuses page-locked memory
                log.warning("staging: page-locked host memory refused (%s); staging "
                            "through pageable memory (copies are then synchronous)", e)
                self.pinned = False
        return torch.empty(shape, dtype=torch.uint8)

    def _to_host(self, buf: torch.Tensor, chunk: list[tuple[int, int, int]]) -> Any:
        for c0, b0, n in chunk:
            self.copier.copy(buf[b0 : b0 + n], self.blocks[c0 : c0 + n])
        return self.copier.record()

    def _to_cache(self, buf: torch.Tensor, chunk: list[tuple[int, int, int]]) -> Any:
        for c0, b0, n in chunk:
            self.copier.copy(self.blocks[c0 : c0 + n], buf[b0 : b0 + n])
        return self.copier.record()

    def send(self, sock: socket.socket, block_ids: Sequence[int],
             deadline: float | None = None) -> None:
        """P: stream the blocks in order; chunk i+1 is copied out while chunk i is sent."""
        plan = chunks(block_ids, self.per_chunk)
        with self._buffers() as bufs:
            marks: list[Any] = [None, None]
            try:
                if plan:
                    marks[0] = self._to_host(bufs[0], plan[0])
                for i, chunk in enumerate(plan):
                    if i + 1 < len(plan):  # its buffer's previous chunk was sent already
                        marks[(i + 1) % 2] = self._to_host(bufs[(i + 1) % 2], plan[i + 1])
                    self.copier.wait(marks[i % 2])
                    n = sum(r[2] for r in chunk)
                    _send_all(sock, _host_view(bufs[i % 2], n), deadline)
            finally:  # the buffers go back to the pool only once no copy fills them
                for m in marks:
                    self.copier.wait(m)

    def recv(self, sock: socket.socket, block_ids: Sequence[int],
             cancelled: threading.Event) -> None:
        """D: receive the blocks in order into the cache; chunk i is copied in while
        chunk i+1 is received. Returns or raises only when no copy can still write."""
        plan = chunks(block_ids, self.per_chunk)
        with self._buffers() as bufs:
            marks: list[Any] = [None, None]
            try:
                for i, chunk in enumerate(plan):
                    b = i % 2
                    self.copier.wait(marks[b])  # chunk i-2's copy out of this buffer
                    n = sum(r[2] for r in chunk)
                    _recv_exact(sock, _host_view(bufs[b], n), cancelled)
                    if cancelled.is_set():
                        raise ConnectionAbortedError("transfer cancelled")
                    marks[b] = self._to_cache(bufs[b], chunk)
            finally:
                for m in marks:
                    self.copier.wait(m)


def _host_view(buf: torch.Tensor, nblocks: int) -> memoryview:
    return memoryview(buf[:nblocks].numpy().reshape(-1).data).cast("B")


def _send_all(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    # Each send is bounded by the socket's SO_SNDTIMEO; the whole stream by deadline.
    while view:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the peer did not take the stream in time")
        view = view[sock.send(view):]


def _recv_exact(sock: socket.socket, view: memoryview, cancelled: threading.Event) -> None:
    # Each recv is bounded by the socket's SO_RCVTIMEO (io_timeout); cancel() shuts the
    # socket down, so a waiting recv returns at once.
    while view:
        if cancelled.is_set():
            raise ConnectionAbortedError("transfer cancelled")
        k = sock.recv_into(view)
        if k == 0:
            raise ConnectionError("the prefill engine closed the data connection")
        view = view[k:]
