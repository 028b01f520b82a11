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

The stream is the unstaged one, byte for byte, so a staged side talks to an unstaged
one: for kvrelay's block-major cache the blocks in order (chunks of whole blocks, one
copy per run of consecutive ids); for a described cache (vLLM's per-layer views,
layout.TensorCache) the layout's ranges in stream order, cut into chunks of at most the
buffer's bytes (a range may straddle two chunks; one copy per piece). The copies sit
behind ``Copier``: ``CudaCopier`` (a side stream and events) or ``HostCopier``
(synchronous, for a CPU cache: the same code runs in tests on CPU tensors).

Ordering against the engine's own work (``fence``): the side stream is not the stream
the model writes and reads the cache on. An adapter whose engine does not hand a block
over only after the device work on it completed (vLLM's worker: P's lease is made from
the scheduler's view, D's blocks may have been a finished request's a step ago) calls
``fence(block_ids)`` on the engine's thread: an event recorded there, on its current
stream, after the forward passes queued so far; the copies of those blocks issued later
wait for it on the side stream (a device-side wait, no host sync). kvrelay's own engine
needs none: it hands a block to a lease or a load only once the steps that touched it
landed (docs/core.md).

Waits: socket waits are bounded by the socket's kernel timeouts (``io_timeout``) and
the send deadline, as in tcp.py; a device copy is bounded by the copy engine, not by a
peer. ``recv`` returns or raises only once no copy it started can still write into the
cache (its ``finally`` waits for them): a handle that polls DONE or FAILED never writes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvrelay.relay.transports.base import runs
from kvrelay.relay.transports.layout import TensorCache

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # per staging buffer; two per transfer in flight


class Copier(Protocol):
    """Copies between the cache and a staging buffer; ``record`` marks the copies issued
    so far, ``wait`` returns once the copies before a mark are done."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> Any: ...

    def wait(self, mark: Any) -> None: ...

    def now(self) -> Any:
        """A mark of the work the calling thread queued so far (its current stream),
        or None where that work is already done (``fence``)."""
        ...

    def after(self, marks: Sequence[Any]) -> None:
        """Copies issued from now on start only after ``marks`` (from ``now``)."""
        ...


class HostCopier:
    """A cache in host memory: copies are synchronous, so every mark is already done."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        return None

    def wait(self, mark: Any) -> None:
        return None

    def now(self) -> Any:
        return None

    def after(self, marks: Sequence[Any]) -> None:
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

    def now(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.stream.device))
        return ev

    def after(self, marks: Sequence[Any]) -> None:
        for ev in marks:
            self.stream.wait_event(ev)


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


def byte_chunks(ranges: Sequence[tuple[int, int, int]], chunk_bytes: int
                ) -> list[list[tuple[int, int, int, int]]]:
    """Ranges ``(buffer, offset, bytes)`` in stream order cut into chunks of at most
    ``chunk_bytes``; each chunk as pieces ``(buffer, offset, bytes, buffer_at)``, a range
    split where a chunk ends."""
    out: list[list[tuple[int, int, int, int]]] = []
    cur: list[tuple[int, int, int, int]] = []
    at = 0
    for buf, off, n in ranges:
        while n:
            k = min(n, chunk_bytes - at)
            cur.append((buf, off, k, at))
            off, n, at = off + k, n - k, at + k
            if at == chunk_bytes:
                out.append(cur)
                cur, at = [], 0
    if cur:
        out.append(cur)
    return out


# A chunk as copies: (a flat byte view of the cache, its offset in the staging buffer).
Chunk = list[tuple[torch.Tensor, int]]


class _BlockMajor:
    """kvrelay's cache: block ``b`` one contiguous piece; chunks of whole blocks."""

    def __init__(self, kv_cache: torch.Tensor, chunk_bytes: int) -> None:
        self.blocks = cache_bytes(kv_cache)
        self.block_bytes = int(self.blocks.shape[1])
        self.num_blocks = int(self.blocks.shape[0])
        self.per_chunk = max(1, chunk_bytes // self.block_bytes)
        self.buffer_bytes = self.per_chunk * self.block_bytes
        self.device = self.blocks.device

    def plan(self, block_ids: Sequence[int]) -> list[Chunk]:
        bb = self.block_bytes
        return [[(self.blocks[c0 : c0 + n].reshape(-1), b0 * bb) for c0, b0, n in chunk]
                for chunk in chunks(block_ids, self.per_chunk)]


class _Described:
    """vLLM's per-layer views (layout.TensorCache): the layout's ranges, cut by bytes."""

    def __init__(self, cache: TensorCache, chunk_bytes: int) -> None:
        self.cache = cache
        self.block_bytes = cache.layout.block_bytes
        self.num_blocks = cache.num_blocks
        self.buffer_bytes = max(1, chunk_bytes)
        self.device = cache.device

    def plan(self, block_ids: Sequence[int]) -> list[Chunk]:
        ts = self.cache.tensors
        return [[(ts[b][o : o + n], at) for b, o, n, at in chunk]
                for chunk in byte_chunks(self.cache.placement.ranges(block_ids),
                                         self.buffer_bytes)]


class StagedBlocks:
    """The tcp transport's view of a cache it cannot hand to a socket directly: a
    block-major tensor, or a described cache (layout.TensorCache)."""

    def __init__(self, kv_cache: torch.Tensor | TensorCache, *,
                 chunk_bytes: int = CHUNK_BYTES, copier: Copier | None = None,
                 pinned_bytes: int | None = None) -> None:
        """``pinned_bytes``: the most page-locked host memory kept (None: a pair per
        transfer running at once). Buffers are then at most half of it, and a transfer
        that finds every kept pair in use stages through a pageable pair of its own,
        dropped after it (no wait: a transfer never queues for a buffer)."""
        if pinned_bytes is not None:
            chunk_bytes = min(chunk_bytes, pinned_bytes // 2)
        if chunk_bytes < 1:
            raise ValueError(f"staging chunk_bytes must be >= 1, got {chunk_bytes}")
        self.cut = (_Described(kv_cache, chunk_bytes) if isinstance(kv_cache, TensorCache)
                    else _BlockMajor(kv_cache, chunk_bytes))
        self.block_bytes = self.cut.block_bytes
        self.on_cuda = self.cut.device.type == "cuda"
        self.copier: Copier = copier or (CudaCopier(self.cut.device) if self.on_cuda
                                         else HostCopier())
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []  # reused buffer pairs
        self._kept = 0  # pairs allocated to be kept (free or in use)
        self.max_kept = (None if pinned_bytes is None
                         else max(1, pinned_bytes // self.staging_bytes))
        self.pinned = True  # until the allocator refuses
        self._lock = threading.Lock()
        self._pool = self  # whose kept buffer pairs a transfer takes (``view``: another's)
        # Per block: the mark its next copy waits for (fence); None: nothing to wait for.
        self._fences: list[Any] = [None] * self.cut.num_blocks

    def view(self, cache: TensorCache) -> StagedBlocks:
        """The same memory described otherwise (a head part of a lease, layout.head_part):
        a reader sharing this one's copier, fences and kept buffers, so a fence here
        orders its copies too and it adds no page-locked memory."""
        v = copy.copy(self)  # the fences list, lock and copier are shared, not copied
        v.cut = _Described(cache, self.cut.buffer_bytes)
        v.block_bytes = v.cut.block_bytes
        return v

    @property
    def staging_bytes(self) -> int:
        """Host memory one transfer holds (two buffers)."""
        return 2 * self.cut.buffer_bytes

    @property
    def kept_bytes(self) -> int:
        """Host memory held between transfers (the kept pairs)."""
        with self._pool._lock:
            return self._pool._kept * self.staging_bytes

    def fence(self, block_ids: Sequence[int]) -> None:
        """On the engine's thread: later copies of these blocks wait for the device work
        it queued so far (module docstring). O(len(block_ids))."""
        mark = self.copier.now()
        if mark is None:
            return
        fences = self._fences
        with self._lock:
            for b in block_ids:
                if 0 <= b < len(fences):  # others are refused where they are used
                    fences[b] = mark

    def _wait_fences(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            marks = {id(m): m for b in block_ids if (m := self._fences[b]) is not None}
        if marks:
            self.copier.after(list(marks.values()))

    @contextlib.contextmanager
    def _buffers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Page-locked allocation costs milliseconds: pairs are kept and reused (at most
        # one per transfer running at once: max_per_relay per relay on D).
        pool = self._pool
        with pool._lock:
            pair = pool._free.pop() if pool._free else None
            keep = pair is not None or pool.max_kept is None or pool._kept < pool.max_kept
            if pair is None and keep:
                pool._kept += 1
        if pair is None:
            if not keep:
                log.debug("staging: every kept buffer pair in use; this transfer stages "
                          "through pageable memory")
            pair = (pool._buffer(keep), pool._buffer(keep))
        try:
            yield pair
        finally:
            if keep:
                with pool._lock:
                    pool._free.append(pair)

    def _buffer(self, pinned: bool = True) -> torch.Tensor:
        shape = (self.cut.buffer_bytes,)
        if self.on_cuda and self.pinned and pinned:
            try:
                return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # a sandbox that refuses page-locked memory
                log.warning("staging: page-locked host memory refused (%s); staging "
                            "through pageable memory (copies are then synchronous)", e)
                self.pinned = False
        return torch.empty(shape, dtype=torch.uint8)

    def _to_host(self, buf: torch.Tensor, chunk: Chunk) -> Any:
        for piece, at in chunk:
            self.copier.copy(buf[at : at + piece.numel()], piece)
        return self.copier.record()

    def _to_cache(self, buf: torch.Tensor, chunk: Chunk) -> Any:
        for piece, at in chunk:
            self.copier.copy(piece, buf[at : at + piece.numel()])
        return self.copier.record()

    def send(self, sock: socket.socket, block_ids: Sequence[int],
             deadline: float | None = None) -> None:
        """P: stream the blocks in order; chunk i+1 is copied out while chunk i is sent."""
        plan = self.cut.plan(block_ids)
        self._wait_fences(block_ids)
        with self._buffers() as bufs:
            marks: list[Any] = [None, None]
            try:
                if plan:
                    marks[0] = self._to_host(bufs[0], plan[0])
                for i, chunk in enumerate(plan):
                    if i + 1 < len(plan):  # its buffer's previous chunk was sent already
                        marks[(i + 1) % 2] = self._to_host(bufs[(i + 1) % 2], plan[i + 1])
                    self.copier.wait(marks[i % 2])
                    _send_all(sock, _host_view(bufs[i % 2], _nbytes(chunk)), deadline)
            finally:  # the buffers go back to the pool only once no copy fills them
                for m in marks:
                    self.copier.wait(m)

    def recv(self, sock: socket.socket, block_ids: Sequence[int],
             cancelled: threading.Event) -> None:
        """D: receive the blocks in order into the cache; chunk i is copied in while
        chunk i+1 is received. Returns or raises only when no copy can still write."""
        plan = self.cut.plan(block_ids)
        self._wait_fences(block_ids)
        with self._buffers() as bufs:
            marks: list[Any] = [None, None]
            try:
                for i, chunk in enumerate(plan):
                    b = i % 2
                    self.copier.wait(marks[b])  # chunk i-2's copy out of this buffer
                    _recv_exact(sock, _host_view(bufs[b], _nbytes(chunk)), cancelled)
                    if cancelled.is_set():
                        raise ConnectionAbortedError("transfer cancelled")
                    marks[b] = self._to_cache(bufs[b], chunk)
            finally:
                for m in marks:
                    self.copier.wait(m)


def _nbytes(chunk: Chunk) -> int:
    return sum(int(piece.numel()) for piece, _ in chunk)


def _host_view(buf: torch.Tensor, nbytes: int) -> memoryview:
    return memoryview(buf[:nbytes].numpy().data).cast("B")


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
