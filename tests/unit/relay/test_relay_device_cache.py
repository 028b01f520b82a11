"""vLLM KV caches on a GPU (issue 41 item 2), tested up to the device boundary.

On CPU: the device-agnostic paths run on CPU tensors (tcp staged through host
buffers in any stride order, with buffers small enough that ranges straddle chunks;
cuda_ipc's piece-by-piece copy with the CUDA calls faked); a cache that says it is on
a CUDA device (``FakeCuda``: the device is faked, the bytes stay in host memory) is
described instead of refused, and nixl registers it as VRAM, one registration per
allocation. The copies of fenced blocks wait for the mark taken on the engine's
thread. With CUDA (skipped without): the same round trips on CUDA tensors, the fence
against a kernel still writing, nixl VRAM, cuda_ipc between two processes."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.relay import protocol as P
from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.base import PeerInfo, TransferState
from kvrelay.relay.transports.cuda_ipc import CudaIpcTransport, TorchCudaIpc, descriptor
from kvrelay.relay.transports.layout import TensorCache, head_part, layer_cache, tensor_cache
from kvrelay.relay.transports.staging import HostCopier, StagedBlocks, byte_chunks
from kvrelay.relay.transports.tcp import HostBlocks, block_io
from kvrelay.testing.kv import move_over_nixl, move_over_tcp
from tests.unit.relay.test_relay_cuda_ipc import FakeIpc, RecordingTcp, settle
from tests.unit.relay.test_relay_layout import assert_moved, cases, views

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (unit tests only: the bytes stay in
    host memory, so what runs on them is the device-agnostic code)."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", 1)

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True


def on_fake_cuda(v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.as_subclass(FakeCuda) for n, t in v.items()}


# -- staged tcp: any layout, byte for byte -------------------------------------------------

def test_byte_chunks_cut_ranges_where_a_buffer_ends() -> None:
    assert byte_chunks([(0, 10, 5), (1, 0, 3)], 4) == [
        [(0, 10, 4, 0)], [(0, 14, 1, 0), (1, 0, 3, 1)]]
    assert byte_chunks([(0, 0, 8)], 8) == [[(0, 0, 8, 0)]]
    assert byte_chunks([], 8) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(["p", "d", "both"]), st.integers(1, 300))
def test_a_staged_side_moves_any_layout_byte_for_byte(c: dict, staged: str,
                                                      chunk: int) -> None:
    """A GPU P or D (the staged path, on CPU tensors) with an in-place peer or another
    staged one: the stream is the same bytes, whatever the staging buffer's size."""
    shape = {x: c[x] for x in ("order", "layers", "k", "heads", "tokens", "content",
                               "dtype", "pad", "apart")}
    p = views(blocks=c["blocks"][0], fill=True, **shape)
    d = views(blocks=c["blocks"][1], **shape)
    pc = (tensor_cache if staged in ("p", "both") else layer_cache)(p, c["blocks"][0])
    dc = (tensor_cache if staged in ("d", "both") else layer_cache)(d, c["blocks"][1])
    assert pc.layout.name == dc.layout.name
    move_over_tcp(pc, dc, c["remote"], c["local"], chunk_bytes=chunk)
    assert_moved(p, d, c["remote"], c["local"], c["k"])


# -- a cache on a CUDA device is described, not refused --------------------------------------

def test_a_cache_on_a_cuda_device_is_described_and_staged_not_refused() -> None:
    v = views("LBNHC", 3, 6, 1, 2, 4, 8, torch.bfloat16, fill=True)
    cache = layer_cache(on_fake_cuda(v), 6, "FLASH_ATTN")
    assert isinstance(cache, TensorCache)
    assert cache.layout.name == layer_cache(v, 6, "FLASH_ATTN").layout.name
    assert cache.layout.name.startswith("strided:LBNHC:")
    assert isinstance(block_io(cache), StagedBlocks)
    assert isinstance(block_io(layer_cache(v, 6)), HostBlocks)


class RecordingAgent:
    """NIXL's agent as the transport drives it at registration (no NIXL needed)."""

    registered: ClassVar[list[tuple[list[tuple[int, int]], int, str]]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def register(self, spans: Sequence[tuple[int, int]], dev: int, mem: str) -> None:
        self.registered.append((list(spans), dev, mem))

    def metadata(self) -> bytes:
        return b"md"

    def close(self) -> None:
        return None


def test_nixl_registers_a_gpu_cache_as_vram_once_per_allocation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    v = views("LBNHC", 3, 4, 1, 2, 4, 8, torch.float16, apart=True)  # three allocations
    cache = tensor_cache(v, 4)
    gpu = TensorCache(cache.placement, [t.as_subclass(FakeCuda) for t in cache.tensors])
    monkeypatch.setattr(nixl, "NixlAgent", RecordingAgent)
    RecordingAgent.registered = []
    desc = nixl.NixlTransport().register(gpu)
    assert RecordingAgent.registered == [(sorted(cache.placement.buffers), 1, "VRAM")]
    assert (desc["mem"], desc["dev"], desc["layout"]) == ("VRAM", 1, cache.layout.name)
    # Allocations that happen to touch: two registrations in VRAM, one span in DRAM.
    touching = dataclasses.replace(cache.placement, buffers=((4096, 64), (4160, 64)))
    assert nixl.Regions(touching, 0, "VRAM").spans() == [(4096, 64), (4160, 64)]
    assert nixl.Regions(touching, 0, "DRAM").spans() == [(4096, 128)]


# -- the fence: copies wait for the engine's work ----------------------------------------------

class MarkingCopier(HostCopier):
    """Synchronous copies; ``now`` hands out numbered marks, and the log says when a
    copy was told to wait for which."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.marks = 0

    def now(self) -> Any:
        self.marks += 1
        return self.marks

    def after(self, marks: Sequence[Any]) -> None:
        self.log.append(("after", sorted(marks)))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy",))
        super().copy(dst, src)


def staged_send(staged: StagedBlocks, ids: list[int]) -> bytes:
    a, b = socket.socketpair()
    got = bytearray()

    def drain() -> None:
        while chunk := b.recv(1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        staged.send(a, ids)
    finally:
        a.shutdown(socket.SHUT_WR)
        reader.join()
        a.close()
        b.close()
    return bytes(got)


def test_copies_of_fenced_blocks_wait_for_the_latest_mark_before_the_first_copy() -> None:
    v = views("LBNHC", 2, 8, 1, 2, 4, 8, torch.float32, fill=True)
    cache = tensor_cache(v, 8)
    copier = MarkingCopier()
    staged = StagedBlocks(cache, chunk_bytes=100, copier=copier)
    staged.fence([2, 3])  # mark 1
    staged.fence([3])  # mark 2: block 3's work now ends later
    staged.fence([99, -1])  # outside the cache: no block takes mark 3
    sent = staged_send(staged, [2, 3, 5])
    assert copier.log[0] == ("after", [1, 2]) and copier.log[1] == ("copy",)
    assert [e for e in copier.log if e[0] == "after"] == [("after", [1, 2])]
    assert sent == b"".join(bytes(t.numpy()) for t in cache.pieces([2, 3, 5]))
    copier.log.clear()
    staged_send(staged, [5, 6])  # never fenced: nothing to wait for
    assert all(e == ("copy",) for e in copier.log)


def test_a_head_parts_staged_reader_shares_the_caches_fences_and_buffers() -> None:
    """A split lease's part (layout.head_part) read through ``StagedBlocks.view``: the
    fence taken for the whole cache orders its copies, it sends exactly its heads'
    bytes, and it keeps no buffers of its own."""
    v = views("LBNHC", 2, 8, 1, 4, 4, 8, torch.float32, fill=True)
    cache = tensor_cache(v, 8)
    copier = MarkingCopier()
    staged = StagedBlocks(cache, chunk_bytes=100, copier=copier, pinned_bytes=5000)
    part = head_part(cache, 1, 2)
    assert isinstance(part, TensorCache)
    seen = staged.view(part)
    staged.fence([2, 3])  # the engine's thread, before the lease exists
    sent = staged_send(seen, [3, 2])
    assert copier.log[0] == ("after", [1]) and copier.log[1] == ("copy",)
    # LBNHC: per layer, per block, per token its heads 2-3 (the part's), in that order
    want = b"".join(bytes(t[b, 2:4].transpose(0, 1).contiguous().numpy())
                    for t in v.values() for b in (3, 2))
    got = b"".join(bytes(x.numpy()) for x in part.pieces([3, 2]))
    assert sent == got == want
    # the pair it used is the cache's, kept there
    assert seen.kept_bytes == staged.kept_bytes == staged.staging_bytes
    assert len(staged._free) == 1 and staged._kept == 1 and seen._pool is staged


def test_pinned_staging_keeps_at_most_its_budget() -> None:
    cache = tensor_cache(views("LBHNC", 2, 8, 1, 2, 4, 8, torch.float32), 8)
    staged = StagedBlocks(cache, pinned_bytes=5000)
    assert staged.staging_bytes == 5000 and staged.max_kept == 1  # two buffers of 2500
    with staged._buffers() as first, staged._buffers() as second:
        assert first is not second  # the second transfer got buffers of its own
    assert staged.kept_bytes == 5000  # and only the kept pair stays
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        StagedBlocks(cache, pinned_bytes=1)


# -- cuda_ipc: a described cache, piece by piece (CUDA calls faked) ---------------------------

def ipc_peer(cache: TensorCache, ipc: Any) -> PeerInfo:
    d = descriptor(cache, ipc)
    reply = P.decode(P.encode(P.Reply(0, "ok", transport=d))[P.HEADER.size:])
    assert isinstance(reply, P.Reply)
    return PeerInfo("127.0.0.1:1", "p-1", dict(reply.transport))


@pytest.mark.parametrize(("order", "apart"), [("LBNHC", False), ("LBNHC", True),
                                              ("LBHNC", False), ("BLHNC", False),
                                              ("LHBNC", False)])
def test_cuda_ipc_copies_a_described_cache_piece_by_piece(order: str, apart: bool) -> None:
    ipc = FakeIpc()
    p = views(order, 3, 8, 1, 2, 4, 8, torch.float16, fill=True, apart=apart)
    d = views(order, 3, 6, 1, 2, 4, 8, torch.float16, apart=apart)
    pc, dc = tensor_cache(p, 8), tensor_cache(d, 6)
    fallback = RecordingTcp()
    tr = CudaIpcTransport(dc, fallback=fallback, ipc=ipc)
    remote, local = [4, 5, 6, 0, 7], [1, 2, 3, 5, 0]
    st = settle(tr, tr.read(ipc_peer(pc, ipc), "L", "d", remote, local))
    assert st.state is TransferState.DONE and st.nbytes == 5 * pc.layout.block_bytes
    assert fallback.reads == [] and ipc.opened == len(pc.tensors)
    assert len(ipc.copies) == len(pc.tensors)  # one copy call per pair of buffers
    assert_moved(p, d, remote, local, 1)


def test_cuda_ipc_copies_into_fenced_blocks_wait_for_the_mark() -> None:
    ipc = FakeIpc()
    pc = tensor_cache(views("LBNHC", 2, 8, 1, 2, 4, 8, torch.float16, fill=True), 8)
    dc = tensor_cache(views("LBNHC", 2, 8, 1, 2, 4, 8, torch.float16), 8)
    tr = CudaIpcTransport(dc, ipc=ipc)
    peer = ipc_peer(pc, ipc)
    tr.fence([3, 4])  # on vLLM's thread, as DecodeSide.start does
    ipc.copies.clear()
    settle(tr, tr.read(peer, "L", "d", [1, 2], [3, 4]))
    assert ipc.copies[0] == [("after", 1, 0)] and len(ipc.copies) == 2  # then the copy
    ipc.copies.clear()
    settle(tr, tr.read(peer, "L2", "d", [1, 2], [3, 4]))  # a fence is waited for once
    assert len(ipc.copies) == 1 and ipc.copies[0][0][0] != "after"


def test_cuda_ipc_with_another_layout_falls_back_naming_both(
        caplog: pytest.LogCaptureFixture) -> None:
    ipc = FakeIpc()
    pc = tensor_cache(views("LBNHC", 2, 8, 1, 2, 4, 8, torch.float16), 8)
    dc = tensor_cache(views("LBHNC", 2, 8, 1, 2, 4, 8, torch.float16), 8)
    fallback = RecordingTcp()
    tr = CudaIpcTransport(dc, fallback=fallback, ipc=ipc)
    tr.read(ipc_peer(pc, ipc), "L", "d", [1], [2])
    assert fallback.reads == [("L", [1])] and ipc.opened == 0
    assert pc.layout.name in caplog.text and dc.layout.name in caplog.text


def test_cuda_ipc_refuses_block_ids_outside_either_cache() -> None:
    ipc = FakeIpc()
    pc = tensor_cache(views("LBNHC", 2, 8, 1, 2, 4, 8, torch.float16), 8)
    dc = tensor_cache(views("LBNHC", 2, 4, 1, 2, 4, 8, torch.float16), 4)
    tr = CudaIpcTransport(dc, ipc=ipc)
    peer = ipc_peer(pc, ipc)
    for remote, local in (([8], [0]), ([0], [4])):
        st = tr.poll(tr.read(peer, "L", "d", remote, local))
        assert st.state is TransferState.FAILED and "outside a cache" in st.error
    assert ipc.copies == []


# -- on a GPU ------------------------------------------------------------------------------

GPU_SHAPE = dict(order="LBNHC", layers=4, k=1, heads=8, tokens=16, content=256,
                 dtype=torch.bfloat16)  # vLLM's GPU default layout, 256 KiB per block


@needs_cuda
def test_staged_tcp_on_cuda_waits_for_the_kernel_that_wrote_the_blocks() -> None:
    p = views(blocks=32, device="cuda", **GPU_SHAPE)  # type: ignore[arg-type]
    d = views(blocks=32, device="cuda", **GPU_SHAPE)  # type: ignore[arg-type]
    pc, dc = layer_cache(p, 32), layer_cache(d, 32)
    assert isinstance(pc, TensorCache) and isinstance(dc, TensorCache)
    remote, local = [3, 4, 5, 9, 20, 21], [0, 1, 2, 30, 7, 8]
    for rep in range(3):
        torch.cuda._sleep(200_000_000)  # the "forward pass" is still running ...
        for t in pc.tensors:
            t.fill_(rep + 1)  # ... and writes the blocks after it
        staged = StagedBlocks(pc, chunk_bytes=300_000)
        staged.fence(remote)  # on this thread: after the writes queued above
        a, b = socket.socketpair()
        sender = threading.Thread(target=staged.send, args=(a, remote))
        sender.start()
        StagedBlocks(dc, chunk_bytes=256_000).recv(b, local, threading.Event())
        sender.join()
        a.close()
        b.close()
        # recv returned: D's host-to-device copies are done, no sync needed to look.
        for name in d:
            assert bool((d[name][local].view(torch.uint8) == rep + 1).all()), (rep, name)


@needs_cuda
@pytest.mark.skipif(not nixl.available(), reason=nixl.INSTALL_HINT)
def test_nixl_reads_vram_byte_for_byte() -> None:
    p = views(blocks=16, device="cuda", fill=True, **GPU_SHAPE)  # type: ignore[arg-type]
    d = views(blocks=12, device="cuda", **GPU_SHAPE)  # type: ignore[arg-type]
    remote, local = [4, 5, 6, 0, 15], [1, 2, 3, 11, 0]
    move_over_nixl(layer_cache(p, 16), layer_cache(d, 12), remote, local, timeout=30)
    assert_moved(p, d, remote, local, 1)


PRODUCER = """
import json, sys, torch
from kvrelay.relay.transports.cuda_ipc import TorchCudaIpc, descriptor
from kvrelay.relay.transports.layout import layer_cache
from tests.unit.relay.test_relay_layout import views
from tests.unit.relay.test_relay_device_cache import GPU_SHAPE
torch.manual_seed(7)
p = views(blocks=16, device="cuda", fill=True, **GPU_SHAPE)
d = descriptor(layer_cache(p, 16), TorchCudaIpc())
torch.cuda.synchronize()
blocks = {n: t[5].view(torch.uint8).flatten().tolist()[:64] for n, t in p.items()}
print(json.dumps({"desc": d, "blocks": blocks}, default=lambda b: {"hex": b.hex()}), flush=True)
sys.stdin.readline()
"""


def _unhex(x: Any) -> Any:
    if isinstance(x, dict):
        return bytes.fromhex(x["hex"]) if set(x) == {"hex"} else {
            k: _unhex(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unhex(v) for v in x]
    return x


@needs_cuda
def test_cuda_ipc_between_two_processes_with_a_vllm_layout() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        got = json.loads(proc.stdout.readline())
        desc, want = _unhex(got["desc"]), got["blocks"]
        d = views(blocks=16, device="cuda", **GPU_SHAPE)  # type: ignore[arg-type]
        dc = layer_cache(d, 16)
        assert isinstance(dc, TensorCache)
        tr = CudaIpcTransport(dc, ipc=TorchCudaIpc())
        st = settle(tr, tr.read(PeerInfo("127.0.0.1:1", "p", desc), "L", "d", [5], [9]))
        assert st.state is TransferState.DONE, st.error
        for name, first in want.items():
            assert d[name][9].view(torch.uint8).flatten().tolist()[:64] == first, name
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.wait(timeout=30)
