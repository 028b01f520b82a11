"""The cuda_ipc transport: on one host, D copies lease blocks device to device out of
P's KV cache, opened once through CUDA IPC.

P side: ``register(kv_cache)`` exports the cache once (torch's CUDA IPC handle of its
storage) into the descriptor D receives in the HELLO reply, with this host's boot id
and the device's UUID. Where the export is refused (some lent machines run under
gVisor) the descriptor says why instead, and D falls back.

D side: per prefill engine (relay and engine id: a restarted P is opened anew) the
first read decides once (``plan``): the cache is opened when P exported it, P runs on
this host (same boot id), its device is visible here and the block size matches;
otherwise every read of that P goes to the fallback (the tcp transport, staged
through host buffers), and the reason is logged once. A read enqueues one
device-to-device copy per run of consecutive blocks on a side stream and returns;
``poll`` says DONE once the copies' event completed. Copies into blocks the engine
fenced (``fence``, on its own thread) wait on the side stream for the work it had
queued then. Copies already enqueued cannot be stopped: after ``cancel`` the handle
reports FAILED only once they completed, so a handle that polls DONE or FAILED never
writes again (what DRAINING waits for).

Like shm and nixl the read is one-sided: P cannot refuse it, and any process of the
host holding the handle could map the cache, which only an authenticated HELLO hands
out. D copies only the blocks an ACQUIRE reply gave it; the fence at RELEASE decides.
The CUDA calls sit behind ``CudaIpc`` so the logic runs on CPU in tests.

A described cache (vLLM's per-layer views of one or more allocations,
layout.TensorCache) is exported buffer by buffer (one handle per allocation, as flat
byte tensors) with its layout and placement; D checks the layout name instead of the
block size and copies byte ranges: the lease's ranges on both sides cut at each
other's boundaries (layout.cut_pieces), one copy per piece, grouped per pair of
buffers into one ``copy_runs`` call (flat byte tensors: a run is a byte range).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvrelay.relay.transports.base import (
    PeerInfo,
    TransferState,
    TransferStatus,
    Transport,
    runs,
)
from kvrelay.relay.transports.layout import KvPlacement, TensorCache, cut_pieces

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "uint8": torch.uint8}  # uint8: a described cache's buffers, exported as bytes
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class IpcRefused(RuntimeError):
    """CUDA IPC is not possible here (no CUDA, a sandbox without IPC, another host)."""


class CudaIpc(Protocol):
    """The CUDA calls of the transport (``TorchCudaIpc``; a fake in tests)."""

    def export(self, kv_cache: torch.Tensor) -> dict[str, Any]: ...

    def open(self, handle: dict[str, Any]) -> torch.Tensor: ...

    def device_index(self, uuid: str) -> int | None: ...

    def accepts(self, local: torch.Tensor) -> bool: ...

    def copy_runs(self, dst: torch.Tensor, src: torch.Tensor,
                  plan: list[tuple[int, int, int]]) -> Any: ...

    def done(self, mark: Any) -> bool: ...

    def now(self, local: Any) -> Any:
        """A mark of the work the calling thread queued so far on ``local``'s device
        (its current stream); None where there is nothing to wait for."""
        ...

    def after(self, local: Any, marks: list[Any]) -> None:
        """Copies into ``local`` enqueued from now on start only after ``marks``."""
        ...


def boot_id() -> str:
    """This host's identity for 'same host' (a container shares the host's boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def descriptor(kv_cache: torch.Tensor | TensorCache, ipc: CudaIpc) -> dict[str, Any]:
    """P: what the HELLO reply tells D; ``refused`` names why there is no handle."""
    if isinstance(kv_cache, TensorCache):
        return _described_descriptor(kv_cache, ipc)
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    try:
        handle = ipc.export(kv_cache)
    except Exception as e:  # any refusal: D falls back, P goes on serving tcp
        log.warning("cuda_ipc: cannot export the KV cache (%s); decode engines will "
                    "use tcp", e)
        return {"refused": str(e), "block_bytes": block_bytes}
    return {"handle": handle, "boot_id": boot_id(), "block_bytes": block_bytes,
            "shape": list(kv_cache.shape), "dtype": DTYPE_NAMES[kv_cache.dtype]}


def _described_descriptor(cache: TensorCache, ipc: CudaIpc) -> dict[str, Any]:
    """One handle per buffer (allocation), with the layout and placement."""
    block_bytes = cache.layout.block_bytes
    try:
        handles = [ipc.export(t) for t in cache.tensors]
    except Exception as e:  # any refusal: D falls back, P goes on serving tcp
        log.warning("cuda_ipc: cannot export the KV cache (%s); decode engines will "
                    "use tcp", e)
        return {"refused": str(e), "block_bytes": block_bytes}
    return {"handle": handles[0], "buffers": handles, "boot_id": boot_id(),
            "block_bytes": block_bytes, "layout": cache.layout.name,
            "placement": cache.placement.to_wire()}


def plan(desc: dict[str, Any], local: torch.Tensor | TensorCache, ipc: CudaIpc) -> str | None:
    """D: why this P cannot be read through IPC (None: it can)."""
    if "refused" in desc:
        return f"the prefill engine could not export its cache: {desc['refused']}"
    if "handle" not in desc:
        return "the prefill engine offers no CUDA IPC handle"
    if not ipc.accepts(local):  # type: ignore[arg-type]  # a TensorCache has .device too
        return f"this engine's KV cache is on {local.device}"
    if desc.get("boot_id") != boot_id():
        return "the prefill engine runs on another host"
    if ipc.device_index(str(desc["handle"].get("uuid", ""))) is None:
        return "the prefill engine's GPU is not visible here"
    if isinstance(local, TensorCache):
        if "buffers" not in desc or desc.get("layout") != local.layout.name:
            return (f"the prefill engine's block layout is {desc.get('layout')}, this "
                    f"engine's {local.layout.name}")
        return None
    block_bytes = local[0].numel() * local.element_size()
    if desc.get("block_bytes") != block_bytes or DTYPES.get(desc.get("dtype", "")) != local.dtype:
        return "the prefill engine's block layout differs"
    return None


class TorchCudaIpc:
    """CUDA IPC through torch's own sharing of CUDA storages (torch.multiprocessing)."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def export(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        if kv_cache.device.type != "cuda":
            raise IpcRefused(f"the KV cache is on {kv_cache.device}, not a CUDA device")
        _, args = reduce_tensor(kv_cache)
        (_, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
         offset_bytes, _, ref_handle, ref_offset, event_handle, event_sync) = args
        return {
            "uuid": str(torch.cuda.get_device_properties(device).uuid),
            "dtype": DTYPE_NAMES[dtype],
            "size": list(size), "stride": list(stride), "offset": int(offset),
            "storage": storage_cls.__name__, "handle": bytes(handle),
            "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes),
            "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle is not None else None,
            "event_sync": bool(event_sync),
        }

    def open(self, handle: dict[str, Any]) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        device = self.device_index(handle["uuid"])
        if device is None:
            raise IpcRefused("the exporting GPU is not visible here")
        storage_cls = {"TypedStorage": torch.storage.TypedStorage,
                       "UntypedStorage": torch.UntypedStorage}[handle["storage"]]
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle["size"]), tuple(handle["stride"]),
            handle["offset"], storage_cls, DTYPES[handle["dtype"]], device, handle["handle"],
            handle["size_bytes"], handle["offset_bytes"], False, handle["ref_handle"],
            handle["ref_offset"], handle["event_handle"], handle["event_sync"])

    def accepts(self, local: torch.Tensor) -> bool:
        return local.device.type == "cuda"

    def device_index(self, uuid: str) -> int | None:
        if not torch.cuda.is_available():
            return None
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                return i
        return None

    def _stream(self, device: torch.device) -> Any:
        dev = device.index or 0
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(device=device)
        return stream

    def now(self, local: Any) -> Any:
        if local.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(local.device))
        return ev

    def after(self, local: Any, marks: list[Any]) -> None:
        stream = self._stream(local.device)
        for ev in marks:
            stream.wait_event(ev)

    def copy_runs(self, dst: torch.Tensor, src: torch.Tensor,
                  plan: list[tuple[int, int, int]]) -> Any:
        stream = self._stream(dst.device)
        with torch.cuda.stream(stream):
            for s0, d0, n in plan:
                dst[d0 : d0 + n].copy_(src[s0 : s0 + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def done(self, mark: Any) -> bool:
        return bool(mark.query())


@dataclass
class IpcHandle:
    started: float
    nbytes: int
    mark: Any = None
    cancelled: bool = False
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))


@dataclass
class FallbackHandle:
    """A read that went to the fallback transport (IPC refused for its prefill engine)."""

    handle: Any


@dataclass
class _Peer:
    remote: torch.Tensor | None  # P's cache opened here, or None: use the fallback
    why: str = ""
    # A described cache: P's buffers opened here and its placement.
    buffers: list[torch.Tensor] | None = None
    placement: KvPlacement | None = None


class CudaIpcTransport:
    name = "cuda_ipc"

    def __init__(self, kv_cache: torch.Tensor | TensorCache | None = None, *,
                 fallback: Transport | None = None, ipc: CudaIpc | None = None) -> None:
        self.kv_cache = kv_cache
        self.fallback = fallback
        self.ipc: CudaIpc = ipc or TorchCudaIpc()
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._lock = threading.Lock()
        self._fences: dict[int, Any] = {}  # local block -> the mark its copies wait for

    def fence(self, block_ids: Sequence[int]) -> None:
        """On the engine's thread: later copies into these blocks wait for the device
        work it queued so far (staging.StagedBlocks.fence, for the same reason: a block
        vLLM freed a step ago may still be used by a forward pass in flight)."""
        mark = self.ipc.now(self.kv_cache)
        if mark is None:
            return
        with self._lock:
            for b in block_ids:
                self._fences[b] = mark

    def _wait_fences(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            marks = {id(m): m for b in block_ids if (m := self._fences.pop(b, None)) is not None}
        if marks:
            self.ipc.after(self.kv_cache, list(marks.values()))

    def register(self, kv_cache: Any) -> dict[str, Any]:
        return descriptor(kv_cache, self.ipc)

    def read(self, peer: PeerInfo, lease_id: str, holder: str, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], *, attempt: str = "") -> Any:
        p = self._peer(peer)
        if p.remote is None:
            if self.fallback is None:
                return self._failed(f"cuda_ipc refused and no fallback: {p.why}")
            return FallbackHandle(self.fallback.read(peer, lease_id, holder, remote_blocks,
                                                     local_blocks, attempt=attempt))
        if p.buffers is not None and p.placement is not None:
            return self._copy_pieces(p.buffers, p.placement, list(remote_blocks),
                                     list(local_blocks))
        return self._copy(p.remote, list(remote_blocks), list(local_blocks))

    def name_of(self, handle: Any) -> str:
        """cuda_ipc, or the fallback's name for a read that went to it (metrics)."""
        if isinstance(handle, FallbackHandle):
            return str(getattr(self.fallback, "name", "fallback"))
        return self.name

    def poll(self, handle: Any) -> TransferStatus:
        if isinstance(handle, FallbackHandle):
            assert self.fallback is not None
            return self.fallback.poll(handle.handle)
        h: IpcHandle = handle
        marks = h.mark if isinstance(h.mark, list) else [h.mark]
        if h.status.state is TransferState.PENDING and all(self.ipc.done(m) for m in marks):
            h.status = (TransferStatus(TransferState.FAILED, error="cuda_ipc transfer cancelled")
                        if h.cancelled else
                        TransferStatus(TransferState.DONE, nbytes=h.nbytes,
                                       seconds=time.perf_counter() - h.started))
        return h.status

    def cancel(self, handle: Any) -> None:
        """Enqueued copies run to their end: poll says FAILED once they did."""
        if isinstance(handle, FallbackHandle):
            assert self.fallback is not None
            self.fallback.cancel(handle.handle)
        else:
            handle.cancelled = True

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
        close = getattr(self.fallback, "close", None)
        if close is not None:
            close()

    def _peer(self, peer: PeerInfo) -> _Peer:
        key = (peer.relay, peer.engine_id)
        with self._lock:
            p = self._peers.get(key)
        if p is not None:
            return p
        assert self.kv_cache is not None, "the cuda_ipc transport has no local KV cache"
        desc = peer.descriptor
        why = plan(desc, self.kv_cache, self.ipc)
        p = _Peer(None)
        if why is None:
            try:
                if isinstance(self.kv_cache, TensorCache):
                    p.buffers = [self.ipc.open(h) for h in desc["buffers"]]
                    p.placement = self.kv_cache.placement.remote(desc["placement"])
                    p.remote = p.buffers[0]
                else:
                    p.remote = self.ipc.open(desc["handle"]).view(tuple(desc["shape"]))
            except Exception as e:  # refused here (a sandbox): fall back, once per P
                why = f"opening the prefill engine's CUDA IPC handle failed: {e}"
                p = _Peer(None)
        if why is not None:
            log.warning("cuda_ipc with %s (%s): %s; using tcp staged through host memory",
                        peer.relay, peer.engine_id, why)
            p.why = why
        with self._lock:
            self._peers[key] = p
        return p

    def _copy_pieces(self, remote: list[torch.Tensor], theirs: KvPlacement, src: list[int],
                     dst: list[int]) -> IpcHandle:
        """A described cache: one copy per piece, one ``copy_runs`` per buffer pair."""
        local = self.kv_cache
        assert isinstance(local, TensorCache)
        if any(not 0 <= b < theirs.num_blocks for b in src) or any(
                not 0 <= b < local.num_blocks for b in dst):
            return self._failed("cuda_ipc: a block id is outside a cache")
        if len(src) != len(dst):
            return self._failed("cuda_ipc: remote and local block counts differ")
        groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for (lb, lo, n), (rb, ro, _) in cut_pieces(local.placement.ranges(dst),
                                                   theirs.ranges(src)):
            groups.setdefault((lb, rb), []).append((ro, lo, n))
        h = IpcHandle(started=time.perf_counter(), nbytes=len(dst) * local.layout.block_bytes)
        marks: list[Any] = []
        try:
            self._wait_fences(dst)
            for (lb, rb), pieces in groups.items():
                marks.append(self.ipc.copy_runs(local.tensors[lb], remote[rb], pieces))
            h.mark = marks
        except Exception as e:  # nothing enqueued past the failing copy can be told apart
            h.status = TransferStatus(TransferState.FAILED,
                                      error=f"cuda_ipc transfer failed: {e!r}")
            self._settle(h)
        return h

    def _copy(self, remote: torch.Tensor, src: list[int], dst: list[int]) -> IpcHandle:
        local = self.kv_cache
        assert isinstance(local, torch.Tensor)
        block_bytes = local[0].numel() * local.element_size()
        if any(not 0 <= b < remote.shape[0] for b in src) or any(
                not 0 <= b < local.shape[0] for b in dst):
            return self._failed("cuda_ipc: a block id is outside a cache")
        h = IpcHandle(started=time.perf_counter(), nbytes=len(dst) * block_bytes)
        try:
            self._wait_fences(dst)
            h.mark = self.ipc.copy_runs(local, remote, runs(src, dst))
        except Exception as e:  # nothing enqueued past the failing copy can be told apart
            h.status = TransferStatus(TransferState.FAILED,
                                      error=f"cuda_ipc transfer failed: {e!r}")
            self._settle(h)
        return h

    def _settle(self, h: IpcHandle) -> None:
        # A copy that failed to enqueue may follow some that did: wait for the stream.
        if torch.cuda.is_available() and self.kv_cache is not None \
                and self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)

    @staticmethod
    def _failed(error: str) -> IpcHandle:
        return IpcHandle(started=0.0, nbytes=0,
                         status=TransferStatus(TransferState.FAILED, error=error))
