"""The nixl transport: D reads the leased blocks straight out of P's KV cache with NIXL.

NIXL (NVIDIA's inference transfer library, over UCX) moves bytes between registered
memory regions with one-sided READs; UCX picks the wire (shm/cma on one host, tcp or
RDMA across hosts; ``UCX_TLS`` narrows it). Both sides register their whole KV cache
once (DRAM, or VRAM when the cache is on a GPU): kvrelay's block-major cache as one
region, vLLM's (a described layout, layout.py) as the buffers its layers view: in host
memory merged where they touch (one storage: one registration), in VRAM one
registration per buffer (per device allocation; the device index from the tensor).

P side: ``register(kv_cache)`` creates the agent, registers the cache and returns the
descriptor D receives in the HELLO reply: the agent's metadata (its UCX address and
the memory keys of the registered region), the region's address and the block size,
and the cache's placement (layout.KvPlacement: where each layer's blocks lie).

D side: ``read`` loads P's agent metadata once per P (a restarted P has a new agent
name), cuts P's ranges of the lease's blocks and its own (in the layout's stream
order) at each other's boundaries and posts **one** READ with one descriptor per piece:
one per run of consecutive ids on both sides where a run is contiguous; ``poll`` asks
NIXL.
Descriptor count is what costs in NIXL (vLLM's per-layer, per-block descriptors were
its main overhead): a block-major cache makes a block one contiguous piece across all
layers, and a run of blocks one piece; a layer-major cache makes a run one piece per
layer (one descriptor per layer and run, never one per layer and block).

Like shm, the read is one-sided: P cannot refuse it, and the registered region is
readable by any agent that has P's metadata, which only an authenticated HELLO gives.
D reads only the blocks of a lease it holds (the ACQUIRE reply's block ids), and the
fence at RELEASE (lease.py) decides whether the copy counts. A handle that polls DONE
or FAILED never writes again: a cancelled READ that was posted is FAILED only once NIXL
reports it ended (NIXL's release of a READ in flight does not stop its writes), and
so is one that failed: NIXL reports an error as soon as one part fails, while the
others may still be landing, so a failed READ polls PENDING with its ``error`` until
NIXL says the whole READ completed; the receiver falls back at once and quarantines
its blocks until then (``kvrelay_kv_quarantined_blocks``). If NIXL never says so, they
stay quarantined: lost capacity that the metric shows, never a block reused under a
write.

NIXL's Python wrapper starts its progress thread with no idle delay, which keeps a core
busy polling; the agent here is built on NIXL's bindings with a progress thread that
sleeps ``KVRELAY_NIXL_PROGRESS_DELAY_US`` (200) when idle (measured: ~1 core -> ~2 % of
one), and UCX is told to guard its worker with a mutex, not a spinlock
(``UCX_ENV_DEFAULTS``): the thread
would otherwise spin through every READ that copies inside its post (cma), on the very
core doing the copy.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrelay import env
from kvrelay.relay.transports.base import (
    PeerInfo,
    TransferState,
    TransferStatus,
    injected_delay,
)
from kvrelay.relay.transports.layout import (
    HostCache,
    KvLayout,
    KvPlacement,
    TensorCache,
    cut_pieces,
    describe,
)

log = logging.getLogger(__name__)

# UCX guards a worker that a progress thread shares with a spinlock by default. Over cma
# (one host) D's READ copies inside its post, holding that lock; the progress thread,
# waking meanwhile, spins on the lock until the copy ends, and on the core the copy runs
# on (a vLLM engine pinned to one) that halves the copy, whatever its delay (measured with
# bench/nixl_micro.py: 7.5 ms -> 3.7 ms for SmolLM2's 3 blocks, as without the thread). A
# mutex puts the waiting thread to sleep. Set before the UCX backend reads its config;
# an operator's own UCX_USE_MT_MUTEX wins.
UCX_ENV_DEFAULTS = {"UCX_USE_MT_MUTEX": "y"}
INSTALL_HINT = (
    "the nixl transport needs NIXL: pip install 'kvrelay[nixl]' (nixl-cu12, installed "
    "with --no-deps so that it keeps the pinned torch)"
)


class NixlUnavailable(RuntimeError):
    pass


class NixlError(ConnectionError):
    """A NIXL call failed (NIXL's own exceptions derive from Exception only)."""


def bindings() -> Any:
    """NIXL's native bindings (``nixl-cu12``; ``nixl-cu13`` on a CUDA 13 image, as the
    lent GPUs run; or a ``nixl`` built from source)."""
    errors = []
    for module in ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl._bindings"):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(str(e))
    raise NixlUnavailable(f"{INSTALL_HINT} ({'; '.join(errors)})")


def available() -> bool:
    try:
        bindings()
    except NixlUnavailable:
        return False
    return True


@dataclass(frozen=True)
class Regions:
    """Where this side's KV blocks lie (``placement``, transports/layout.py), and the
    device. A block-major cache is described as one layer whose block is one piece."""

    placement: KvPlacement
    dev: int
    mem: str  # NIXL memory type: DRAM or VRAM

    @property
    def num_blocks(self) -> int:
        return self.placement.num_blocks

    @property
    def piece_bytes(self) -> int:
        return self.placement.layout.piece_bytes

    @property
    def block_bytes(self) -> int:
        return self.placement.layout.block_bytes

    @property
    def addrs(self) -> list[int]:
        """Each layer's block 0 (what a descriptor named before placements)."""
        bufs = self.placement.buffers
        return [bufs[b][0] + off for b, off in self.placement.bases]

    def spans(self) -> list[tuple[int, int]]:
        """(address, bytes) to register: in host memory the buffers, merged where they
        touch or overlap (vLLM's layers are views of one storage: one registration);
        in VRAM one registration per buffer (per allocation), never merged: two device
        allocations that happen to touch are still two (a registration may not span
        them), and a buffer is one storage, so within one allocation."""
        if self.mem == "VRAM":
            return sorted(set(self.placement.buffers))
        out: list[tuple[int, int]] = []
        for a, n in sorted(self.placement.buffers):
            if out and a <= out[-1][0] + out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], a + n - out[-1][0]))
            else:
                out.append((a, n))
        return out

    def rows(self, placement: KvPlacement, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(address, bytes) of ``block_ids`` under ``placement`` (this side's or the
        peer's), in stream order."""
        bufs = placement.buffers
        return [(bufs[b][0] + off, n) for b, off, n in placement.ranges(block_ids)]


def regions_of(kv_cache: Any) -> Regions:
    """The regions of a block-major contiguous torch KV cache (any device), or of a
    described cache (layout.layer_cache: a HostCache, or a TensorCache on a GPU)."""
    import torch

    if isinstance(kv_cache, HostCache):
        return Regions(kv_cache.placement, 0, "DRAM")
    if isinstance(kv_cache, TensorCache):  # the memory type from the tensors' device
        dev = kv_cache.device
        if dev.type == "cpu":
            return Regions(kv_cache.placement, 0, "DRAM")
        if dev.type != "cuda":
            raise TypeError(f"the nixl transport registers host or CUDA memory, not {dev}")
        return Regions(kv_cache.placement, dev.index or 0, "VRAM")
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError("the nixl transport needs a KV cache tensor or a described cache "
                        "(layout.layer_cache)")
    if not kv_cache.is_contiguous():
        raise TypeError("the nixl transport needs a contiguous block-major KV cache")
    blocks = kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], 1, 1, -1)
    placement, _ = describe({"kv_cache": blocks})
    dev = kv_cache.get_device()
    return Regions(placement, max(dev, 0), "VRAM" if dev >= 0 else "DRAM")


def pair_rows(local: list[tuple[int, int]], remote: list[tuple[int, int]]
              ) -> tuple[np.ndarray, np.ndarray]:
    """Cut two lists of (address, bytes) covering the same stream at each other's
    boundaries (layout.cut_pieces): row ``i`` of the first receives row ``i`` of the
    second."""
    pairs = cut_pieces([(0, a, n) for a, n in local], [(0, a, n) for a, n in remote])
    return (np.asarray([(o, n) for (_, o, n), _ in pairs], dtype=np.uint64).reshape(-1, 2),
            np.asarray([(o, n) for _, (_, o, n) in pairs], dtype=np.uint64).reshape(-1, 2))


def legacy_placement(local: KvPlacement, regions: Sequence[int], num_blocks: int,
                     piece: int) -> KvPlacement:
    """A peer's placement from a descriptor without one (kvrelay before layouts as
    descriptions): block ``b`` at ``region + b * piece`` in each region, which is this
    side's stream only where each layer's block is one piece here too."""
    lay = local.layout
    if not (lay.contiguous and lay.kernel_blocks == 1) or (len(regions), piece) != (
            lay.layers, lay.piece_bytes):
        raise ValueError(f"the prefill engine cuts a block into {len(regions)} pieces "
                         f"of {piece} bytes, this engine {lay.layers} of {lay.piece_bytes}")
    flat = KvLayout("LBC" if len(regions) > 1 else "BC", len(regions), 1, 1, 1, piece, 1)
    return KvPlacement(flat, num_blocks, tuple((int(a), num_blocks * piece) for a in regions),
                       tuple((i, 0) for i in range(len(regions))),
                       (0, piece, 1) if len(regions) > 1 else (piece, 1))


class NixlAgent:
    """One NIXL agent with the UCX backend; every call under one lock (NIXL's agent is
    built without its own thread synchronisation)."""

    def __init__(self, name: str) -> None:
        b = self.b = bindings()
        cfg = b.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.pthrDelay = env.get("KVRELAY_NIXL_PROGRESS_DELAY_US")
        cfg.syncMode = b.NIXL_THREAD_SYNC_NONE
        if hasattr(cfg, "captureTelemetry"):  # NIXL's own clock of each READ (own_seconds)
            cfg.captureTelemetry = True
        self.name = name
        self.lock = threading.Lock()
        self.agent = b.nixlAgent(name, cfg)
        if "UCX" not in self.agent.getAvailPlugins():
            raise NixlUnavailable("NIXL has no UCX plugin here")
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.agent.createBackend("UCX", {})
        self.mems = {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG}
        self._regs: list[Any] = []

    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Under the lock; NIXL's exceptions become ``NixlError`` naming the call."""
        with self.lock:
            try:
                yield
            except Exception as e:
                if type(e).__module__.split(".")[0].startswith("nixl"):
                    raise NixlError(f"NIXL {what}: {type(e).__name__}: {e}") from None
                raise

    def register(self, spans: Sequence[tuple[int, int]], dev: int, mem: str) -> None:
        descs = self.b.nixlRegDList(self.mems[mem], [(a, n, dev, "") for a, n in spans])
        with self._call("register"):
            self.agent.registerMem(descs, [])
            self._regs.append(descs)

    def metadata(self) -> bytes:
        with self._call("metadata"):
            return bytes(self.agent.getLocalMD())

    def load_remote(self, metadata: bytes) -> str:
        with self._call("loading the prefill engine's metadata"):
            name = self.agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget_remote(self, name: str) -> None:
        with self.lock, contextlib.suppress(Exception):
            self.agent.invalidateRemoteMD(name)

    def read(self, remote_agent: str, local: np.ndarray, remote: np.ndarray, mem: str,
             remote_mem: str) -> tuple[int, str, bool]:
        """Create and post one READ of ``remote`` rows into ``local`` rows (N x 3 uint64:
        address, bytes, device). Returns the transfer handle, '' or, when posting
        failed, why (a post that failed may have posted some parts: NIXL posts one
        request per part, so the handle is kept and polled like any other), and whether
        the READ completed within the post (UCX over cma copies inside it)."""
        b = self.b
        ldl = b.nixlXferDList(self.mems[mem], local)
        rdl = b.nixlXferDList(self.mems[remote_mem], remote)
        with self._call("creating the READ"):  # nothing posted yet if this fails
            handle = int(self.agent.createXferReq(b.NIXL_READ, ldl, rdl, remote_agent, b"",
                                                  []))
        try:
            with self._call("posting the READ"):
                status = self.agent.postXferReq(handle, b"")
        except NixlError as e:
            return handle, str(e), False
        if status not in (b.NIXL_SUCCESS, b.NIXL_IN_PROG):
            return handle, f"NIXL refused the READ (status {status})", False
        return handle, "", status == b.NIXL_SUCCESS

    def own_seconds(self, handle: int) -> float:
        """The READ by NIXL's clock (its telemetry: posted to seen complete in NIXL);
        0.0 where NIXL keeps none."""
        with self.lock:
            try:
                return float(self.agent.getXferTelemetry(handle).xferDuration) / 1e6
            except Exception:
                return 0.0

    def state(self, handle: int) -> tuple[TransferState, str]:
        """DONE only when NIXL says the whole READ completed. An error (a status, or
        an exception asking) is PENDING with the error: NIXL reports a failed part
        while other parts may still be landing, so the READ may still write."""
        b = self.b
        try:
            with self._call("transfer status"):
                status = self.agent.getXferStatus(handle)
        except NixlError as e:
            return TransferState.PENDING, str(e)
        if status == b.NIXL_SUCCESS:
            return TransferState.DONE, ""
        if status == b.NIXL_IN_PROG:
            return TransferState.PENDING, ""
        return TransferState.PENDING, f"NIXL reported status {status}"

    def release(self, handle: int) -> bool:
        """Release a transfer; for one still in progress NIXL tries to cancel it.
        False when it could not (the READ may still write: try again later)."""
        with self.lock:
            try:
                self.agent.releaseXferReq(handle)
            except Exception:
                return False
        return True

    def close(self) -> None:
        with self.lock:
            for descs in self._regs:
                with contextlib.suppress(Exception):
                    self.agent.deregisterMem(descs, [])
            self._regs.clear()


@dataclass
class NixlHandle:
    lease_id: str
    remote_agent: str
    local: np.ndarray
    remote: np.ndarray
    remote_mem: str
    nbytes: int
    started: float
    not_before: float = 0.0  # fault injection: post no earlier than this
    xfer: int | None = None  # NIXL's transfer handle once posted
    cancelled: bool = False
    status: TransferStatus | None = None  # final once set
    descriptors: int = 0
    own_seconds: float = 0.0  # NIXL's clock of the READ, once it ended
    error: str = ""  # the READ failed, but may still write until NIXL says it ended


class NixlTransport:
    name = "nixl"

    def __init__(self, kv_cache: Any = None, *, agent_name: str | None = None) -> None:
        self.agent_name = agent_name or f"kvrelay-{os.getpid()}-{secrets.token_hex(6)}"
        self.agent: NixlAgent | None = None
        self.kv_cache = kv_cache
        self.local: Regions | None = None
        self._remotes: dict[str, str] = {}  # relay address -> loaded agent name
        self.delay = injected_delay()
        if kv_cache is not None:
            self._register(kv_cache)

    def _register(self, kv_cache: Any) -> Regions:
        regions = regions_of(kv_cache)
        if self.agent is None:
            self.agent = NixlAgent(self.agent_name)
        self.agent.register(regions.spans(), regions.dev, regions.mem)
        self.kv_cache, self.local = kv_cache, regions
        return regions

    # -- P side ------------------------------------------------------------------
    def register(self, kv_cache: Any) -> dict[str, Any]:
        """Register P's cache once (a tensor, or region views: ``regions_of``); the
        descriptor travels in the HELLO reply. ``addr`` and ``nbytes``: the first
        region (for a block-major cache, the whole cache)."""
        r = (self.local if self.local is not None and kv_cache is self.kv_cache
             else self._register(kv_cache))
        assert self.agent is not None
        # regions/piece_bytes: for a D from before placements (legacy_placement).
        return {"agent": self.agent.name, "metadata": self.agent.metadata(),
                "addr": r.addrs[0], "nbytes": r.num_blocks * r.piece_bytes,
                "regions": r.addrs, "num_blocks": r.num_blocks,
                "piece_bytes": r.piece_bytes, "dev": r.dev, "mem": r.mem,
                "block_bytes": r.block_bytes, "layout": r.placement.layout.name,
                "placement": r.placement.to_wire()}

    # -- D side ------------------------------------------------------------------
    def read(self, peer: PeerInfo, lease_id: str, holder: str, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], *, attempt: str = "") -> NixlHandle:
        now = time.perf_counter()
        h = NixlHandle(lease_id, "", np.empty((0, 3), np.uint64), np.empty((0, 3), np.uint64),
                       "DRAM", 0, now, not_before=now + self.delay)
        try:
            h.remote_agent, h.remote_mem, h.local, h.remote, h.nbytes = self._plan(
                peer, remote_blocks, local_blocks)
            h.descriptors = len(h.local)
            if not self.delay:
                self._post(h)
        except (NixlUnavailable, ConnectionError, KeyError, TypeError, ValueError,
                RuntimeError) as e:
            h.status = TransferStatus(TransferState.FAILED, error=f"nixl transfer failed: {e}")
        return h

    def poll(self, h: NixlHandle) -> TransferStatus:
        """Final (DONE or FAILED) only once NIXL said the whole READ completed and it was
        released. A READ that failed is PENDING with ``error`` set until then: the
        receiver falls back at once and keeps its blocks quarantined, never reused
        while a part may still write into them."""
        if h.status is not None:
            return h.status
        assert self.agent is not None
        try:
            if h.xfer is None:
                if h.cancelled:
                    return self._end(h, TransferState.FAILED, "nixl transfer cancelled")
                if time.perf_counter() < h.not_before:
                    return TransferStatus(TransferState.PENDING)
                self._post(h)
                if h.status is not None:
                    return h.status
                assert h.xfer is not None
            state, err = self.agent.state(h.xfer)
        except (ConnectionError, RuntimeError, ValueError) as e:
            state, err = TransferState.PENDING, str(e)  # unknown: it may still write
        if err and not h.error:
            h.error = f"nixl transfer failed: {err}"
            log.warning("%s; its blocks stay quarantined until NIXL reports the READ "
                        "complete", h.error)
        if state is TransferState.PENDING:
            # Even when cancelled: releasing a READ in flight does not stop it (measured
            # over UCX tcp: NIXL accepted the release and bytes kept landing for tens of
            # ms), so a cancelled or failed READ is drained to its end, never cut short.
            return TransferStatus(TransferState.PENDING, error=h.error)
        return self._ended(h)

    def _ended(self, h: NixlHandle) -> TransferStatus:
        """NIXL said the whole READ completed: release it, then the final status."""
        assert self.agent is not None
        if h.xfer is not None:
            own = self.agent.own_seconds(h.xfer)
            if not self.agent.release(h.xfer):
                return TransferStatus(TransferState.PENDING, error=h.error)
            h.own_seconds, h.xfer = own, None
        if h.cancelled:
            return self._end(h, TransferState.FAILED, "nixl transfer cancelled")
        if h.error:
            return self._end(h, TransferState.FAILED, h.error)
        return self._end(h, TransferState.DONE)

    def cancel(self, h: NixlHandle) -> None:
        h.cancelled = True
        self.poll(h)

    def close(self) -> None:
        if self.agent is not None:
            for name in self._remotes.values():
                self.agent.forget_remote(name)
            self._remotes.clear()
            self.agent.close()

    # -- internals -----------------------------------------------------------------
    def _plan(self, peer: PeerInfo, remote_blocks: Sequence[int], local_blocks: Sequence[int]
              ) -> tuple[str, str, np.ndarray, np.ndarray, int]:
        if self.local is None or self.agent is None:
            raise RuntimeError("the nixl transport has no local KV cache")
        d = peer.descriptor
        for key in ("agent", "metadata", "regions", "num_blocks", "piece_bytes", "dev",
                    "mem", "block_bytes"):
            if key not in d:
                raise ValueError(f"the prefill engine's nixl descriptor lacks {key!r}")
        loc = self.local
        if int(d["block_bytes"]) != loc.block_bytes:
            raise ValueError(f"block of {d['block_bytes']} bytes on the prefill engine, "
                             f"{loc.block_bytes} here")
        if len(remote_blocks) != len(local_blocks):
            raise ValueError("remote and local block counts differ")
        if any(not 0 <= b < int(d["num_blocks"]) for b in remote_blocks) or any(
                not 0 <= b < loc.num_blocks for b in local_blocks):
            raise ValueError("block id outside the KV cache")
        if "placement" in d:
            if d.get("layout") != loc.placement.layout.name:
                raise ValueError(f"the prefill engine's layout is {d.get('layout')}, this "
                                 f"engine's {loc.placement.layout.name}")
            theirs = loc.placement.remote(d["placement"])
        else:
            theirs = legacy_placement(loc.placement, [int(a) for a in d["regions"]],
                                      int(d["num_blocks"]), int(d["piece_bytes"]))
        agent = self._remote_agent(peer.relay, str(d["agent"]), bytes(d["metadata"]))
        # One descriptor per contiguous range on both sides (a run of consecutive ids
        # per layer for vLLM's LBHNC), never one per layer and block where runs touch.
        lrows, rrows = pair_rows(loc.rows(loc.placement, list(local_blocks)),
                                 loc.rows(theirs, list(remote_blocks)))
        local = np.empty((len(lrows), 3), dtype=np.uint64)
        remote = np.empty((len(rrows), 3), dtype=np.uint64)
        local[:, :2], remote[:, :2] = lrows, rrows
        local[:, 2], remote[:, 2] = loc.dev, int(d["dev"])
        return agent, str(d["mem"]), local, remote, len(local_blocks) * loc.block_bytes

    def _remote_agent(self, relay: str, name: str, metadata: bytes) -> str:
        assert self.agent is not None
        known = self._remotes.get(relay)
        if known == name:
            return name
        if known is not None:  # the prefill engine restarted: a new agent
            self.agent.forget_remote(known)
            del self._remotes[relay]
        loaded = self.agent.load_remote(metadata)
        if loaded != name:
            raise ValueError(f"nixl metadata names agent {loaded!r}, expected {name!r}")
        self._remotes[relay] = loaded
        return loaded

    def _post(self, h: NixlHandle) -> None:
        assert self.agent is not None and self.local is not None
        if not len(h.local):
            h.status = TransferStatus(TransferState.DONE, nbytes=0, seconds=0.0)
            return
        h.started = time.perf_counter()
        try:
            h.xfer, err, complete = self.agent.read(h.remote_agent, h.local, h.remote,
                                                    self.local.mem, h.remote_mem)
        except (ConnectionError, RuntimeError, ValueError) as e:  # nothing was posted
            h.status = TransferStatus(TransferState.FAILED, error=f"nixl transfer failed: {e}")
            return
        if err:  # some parts may have been posted: polled until NIXL says they ended
            h.error = f"nixl transfer failed: {err}"
        elif complete:  # copied within the post: nothing left to write, no status to ask
            self._ended(h)

    def _end(self, h: NixlHandle, state: TransferState, error: str = "") -> TransferStatus:
        h.status = TransferStatus(
            state, error=error,
            nbytes=h.nbytes if state is TransferState.DONE else 0,
            seconds=time.perf_counter() - h.started, ended_at=time.monotonic(),
            own_seconds=h.own_seconds if state is TransferState.DONE else 0.0)
        return h.status
