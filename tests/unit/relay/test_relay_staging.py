"""The tcp transport staged through host buffers (the path of a KV cache on a GPU),
run here on CPU tensors with ``staging=True``: a real relay server and real sockets."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.core.kv_port import PoolLeaseBlocks
from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports.base import PeerInfo, TransferState, byte_view
from kvrelay.relay.transports.staging import StagedBlocks, chunks
from kvrelay.relay.transports.tcp import TcpTransport, block_io

COMPAT = "compat-test"
NBLOCKS = 32
BLOCK_FLOATS = 256  # 1 KiB blocks
CHUNK = 3 * BLOCK_FLOATS * 4  # three blocks per staging buffer: many chunks per read


def wait_for(cond: Callable[[], bool], what: str, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.005)


def test_chunks_keep_the_order_and_group_runs() -> None:
    assert chunks([5, 6, 7, 2, 9, 10], 3) == [[(5, 0, 3)], [(2, 0, 1), (9, 1, 2)]]
    assert chunks([4], 8) == [[(4, 0, 1)]]
    assert chunks([], 2) == []


class Prefill:
    def __init__(self, staged: bool, device: str = "cpu") -> None:
        self.kv = torch.randn(NBLOCKS, BLOCK_FLOATS, device=device)
        self.pool = BlockPool(NBLOCKS)
        self.lock = threading.Lock()
        self.table = LeaseTable(PoolLeaseBlocks(self.pool), engine_id="p-1",
                                acquire_timeout=30.0, hard_cap=60.0)
        blocks = (StagedBlocks(self.kv, chunk_bytes=CHUNK) if staged
                  else block_io(self.kv))
        cfg = RelayServerConfig(compat=COMPAT, transports={"tcp": {}})
        self.server = RelayServer(self.table, self.lock, cfg, kv_blocks=blocks).start()
        self.client = RelayClient(compat=COMPAT, transport="tcp", client_id="d-1")

    def lease(self, rid: str, ids: list[int]) -> str:
        with self.lock:
            got = self.pool.allocate(len(ids), request_owner(rid))
            lease = self.table.create(rid, got, time.monotonic(), num_tokens=len(ids) * 4,
                                      first_token=1)
        sock, _ = self.client.open(self.server.address)
        with sock:
            sock.sendall(P.encode(P.Acquire(1, "p-1", lease.lease_id, "d-1", "a")))
            assert P.recv_frame(sock).status == "ok"  # type: ignore[union-attr]
        return lease.lease_id

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.mark.parametrize(("p_staged", "d_staged"), [(True, True), (True, False), (False, True)])
def test_staged_reads_land_every_byte_in_scattered_blocks(p_staged: bool, d_staged: bool) -> None:
    p = Prefill(p_staged)
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    tr = TcpTransport(dst, connect=p.client.open_data, io_timeout=5.0, staging=d_staged)
    if d_staged:
        tr.blocks = StagedBlocks(dst, chunk_bytes=CHUNK)
    try:
        # P's lease blocks come from its pool (0..6); D's are scattered, runs and gaps.
        local = [20, 21, 3, 9, 10, 11, 30]
        lease_id = p.lease("r", local)
        remote = list(range(len(local)))
        h = tr.read(PeerInfo(p.server.address, "p-1"), lease_id, "d-1", remote, local,
                    attempt="a")
        wait_for(lambda: h.status.state is not TransferState.PENDING, "the read")
        assert h.status.state is TransferState.DONE, h.status.error
        assert h.status.nbytes == len(local) * BLOCK_FLOATS * 4
        assert torch.equal(dst[local], p.kv[remote])
        untouched = sorted(set(range(NBLOCKS)) - set(local))
        assert not dst[untouched].any()
    finally:
        tr.close()
        p.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_caches_on_a_gpu_stage_through_pinned_memory_on_both_sides() -> None:
    p = Prefill(staged=True, device="cuda")  # a CUDA cache: CudaCopier, pinned buffers
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS, device="cuda")
    tr = TcpTransport(dst, connect=p.client.open_data, io_timeout=5.0)  # staged: on a GPU
    try:
        assert isinstance(tr.blocks, StagedBlocks) and tr.blocks.on_cuda
        local = [20, 21, 3, 9, 10, 11, 30]
        lease_id = p.lease("r", local)
        remote = list(range(len(local)))
        h = tr.read(PeerInfo(p.server.address, "p-1"), lease_id, "d-1", remote, local,
                    attempt="a")
        wait_for(lambda: h.status.state is not TransferState.PENDING, "the read")
        assert h.status.state is TransferState.DONE, h.status.error
        assert torch.equal(dst[local], p.kv[remote])
    finally:
        tr.close()
        p.close()


class LateCopier:
    """Host -> cache copies that land 50 ms after they are issued (a slow DMA)."""

    def __init__(self) -> None:
        self.landed: list[float] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        data = src.clone()

        def land() -> None:
            time.sleep(0.05)
            dst.copy_(data)
            self.landed.append(time.monotonic())

        t = threading.Thread(target=land, daemon=True)
        t.start()
        self._last = t

    def record(self) -> Any:
        return self._last

    def wait(self, mark: Any) -> None:
        if mark is not None:
            mark.join()


class HalfPrefill:
    """A fake relay that answers a READ `ok`, sends ``sent`` bytes, then waits."""

    def __init__(self, nbytes: int, sent: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.nbytes, self.sent = nbytes, sent
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def relay(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def connect(self, relay: str) -> socket.socket:
        return socket.create_connection(("127.0.0.1", int(relay.rsplit(":", 1)[1])), 2.0)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            self.conns.append(conn)
            msg = P.recv_frame(conn)
            assert isinstance(msg, P.Read)
            conn.sendall(P.encode(P.Reply(msg.seq, "ok", nbytes=self.nbytes)))
            conn.sendall(b"\1" * self.sent)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.listener.close()


def test_cancel_mid_transfer_drains_before_failed() -> None:
    """The chunk already received is still being copied into the cache when cancel
    comes: FAILED is reported only after that copy landed, and nothing writes after."""
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    block = BLOCK_FLOATS * 4
    fake = HalfPrefill(8 * block, sent=4 * block)  # one chunk (3 blocks) and a bit
    tr = TcpTransport(dst, connect=fake.connect, io_timeout=5.0, staging=True)
    copier = LateCopier()
    tr.blocks = StagedBlocks(dst, chunk_bytes=CHUNK, copier=copier)
    try:
        h = tr.read(PeerInfo(fake.relay, "p"), "L", "d", list(range(8)), list(range(8)))
        wait_for(lambda: fake.conns != [], "the stream")
        time.sleep(0.01)  # the first chunk is received and its late copy issued
        tr.cancel(h)
        wait_for(lambda: tr.poll(h).state is not TransferState.PENDING, "the drain")
        failed_at = time.monotonic()
        assert tr.poll(h).state is TransferState.FAILED
        assert copier.landed and max(copier.landed) <= failed_at
        snapshot = dst.clone()
        time.sleep(0.15)
        assert torch.equal(dst, snapshot)
        assert dst[:3].view(torch.uint8).eq(1).all()  # the chunk that landed
        assert not dst[3:].any()
    finally:
        tr.close()
        fake.close()


def test_a_prefill_frozen_mid_stream_fails_within_io_timeout() -> None:
    dst = torch.zeros(NBLOCKS, BLOCK_FLOATS)
    block = BLOCK_FLOATS * 4
    fake = HalfPrefill(8 * block, sent=4 * block)
    tr = TcpTransport(dst, connect=fake.connect, io_timeout=0.3, staging=True)
    try:
        t0 = time.monotonic()
        h = tr.read(PeerInfo(fake.relay, "p"), "L", "d", list(range(8)), list(range(8)))
        wait_for(lambda: h.status.state is not TransferState.PENDING, "the read to fail")
        assert h.status.state is TransferState.FAILED
        assert "no progress" in h.status.error
        assert time.monotonic() - t0 < 5.0
    finally:
        tr.close()
        fake.close()


def test_a_device_cache_needs_no_host_view() -> None:
    """The bug of issue 11: ``byte_view`` of a CUDA cache raised in ``.numpy()``;
    a cache on a device now picks the staged path by itself."""
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(TypeError, match="no host byte view"):
        byte_view(meta)
    assert isinstance(block_io(meta), StagedBlocks)
    assert isinstance(block_io(torch.zeros(4, 8), staging=True), StagedBlocks)
