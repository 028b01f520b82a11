"""An fp8_e4m3 KV cache (uint8: each head's codes, then its float16 scale) moved P -> D
through a real relay server, over shm, tcp and tcp staged: every byte of each lease's
blocks, scales included, arrives as P holds it. And a decode engine whose KV cache dtype
differs from P's is refused at HELLO by an error that names both dtypes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.relay.client import RelayClient, RelayUnavailable
from kvrelay.relay.geometry import KvGeometry
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.receiver import Receiver, ReceiverConfig, RemoteKv
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports.base import byte_view
from kvrelay.relay.transports.shm import ShmKvCache, ShmTransport
from kvrelay.relay.transports.tcp import TcpTransport
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner
from kvrelay.testing.kv import drive_decode

GEOM = KvGeometry(architecture="fake", num_layers=2, num_kv_heads=2, head_dim=16,
                  block_size=4, dtype="fp8_e4m3", model_dtype="bfloat16")
COMPAT = GEOM.compat_hash()
SHAPE = (32, GEOM.num_layers, 2, GEOM.block_size, GEOM.num_kv_heads, GEOM.head_elems)


class SeenRunner(FakeRunner):
    """D's fake model: records each request's blocks when it first runs (the pulled KV
    is in them then, before any decode step of a real model writes)."""

    def __init__(self, pool: BlockPool) -> None:
        super().__init__(1000, block_size=GEOM.block_size, pool=pool)
        self.first_blocks: dict[str, list[int]] = {}
        self.cache: torch.Tensor | None = None
        self.seen: dict[str, torch.Tensor] = {}

    def execute(self, batch):  # type: ignore[no-untyped-def]
        assert self.cache is not None
        for sr in batch.requests:
            if sr.request_id not in self.seen:
                self.seen[sr.request_id] = self.cache[list(sr.block_ids)].clone()
        out: Mapping = super().execute(batch)
        return out


@pytest.fixture
def prefill() -> Iterator[tuple[RelayServer, LeaseTable, Engine, torch.Tensor, threading.Lock]]:
    shm = ShmKvCache()
    kv = shm.factory(SHAPE, torch.uint8)
    assert kv[0].numel() == GEOM.block_bytes
    kv.random_(0, 256, generator=torch.Generator().manual_seed(3))  # codes and scales
    pool = BlockPool(SHAPE[0])
    lock = threading.Lock()
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id="p-1", acquire_timeout=5.0,
                       hard_cap=60.0)
    cfg = RelayServerConfig(compat=COMPAT, kv_dtype=GEOM.dtype,
                            transports={"shm": shm.descriptor(), "tcp": {}})
    server = RelayServer(table, lock, cfg, kv_bytes=byte_view(kv)).start()
    engine = Engine(SchedulerConfig(num_blocks=SHAPE[0], block_size=GEOM.block_size),
                    FakeRunner(1000, block_size=GEOM.block_size, pool=pool), pool=pool,
                    kv_handoff=server.kv_handoff)
    try:
        yield server, table, engine, kv, lock
    finally:
        server.close()
        shm.close()


@pytest.mark.parametrize("transport", ["shm", "tcp", "tcp_staged"])
def test_fp8_blocks_arrive_byte_for_byte(prefill, transport: str) -> None:  # type: ignore[no-untyped-def]
    server, table, p_engine, p_kv, lock = prefill
    d_kv = torch.zeros(SHAPE, dtype=torch.uint8)
    pool = BlockPool(SHAPE[0])
    runner = SeenRunner(pool)
    runner.cache = d_kv
    engine = Engine(SchedulerConfig(num_blocks=SHAPE[0], block_size=GEOM.block_size), runner,
                    pool=pool)
    client = RelayClient(compat=COMPAT, transport=transport.split("_")[0], client_id="d-1",
                         kv_dtype=GEOM.dtype)
    tr = (ShmTransport(d_kv) if transport == "shm" else
          TcpTransport(d_kv, connect=client.open_data, staging=transport == "tcp_staged"))
    receiver = Receiver(EngineKvLoads(engine), client, tr, holder="d-1", compat=COMPAT,
                        config=ReceiverConfig(rto=0.2, peer_timeout=2.0))
    try:
        leases: dict[str, list[int]] = {}
        for i in range(4):
            rid, prompt = f"r{i}", list(range(100 * i + 1, 100 * i + 4 + 5 * i))
            params = SamplingParams(max_tokens=3, seed=i)
            with lock:
                p_engine.add_request(rid, prompt, params, remote_decode=True)
                while p_engine.has_work():
                    p_engine.step()
                kv = RemoteKv.from_dict(server.kv_params.pop(rid).to_dict())
            leases[rid] = kv.block_ids
            receiver.submit(rid, prompt, params, kv, time.monotonic())
        end = time.monotonic() + 10
        while engine.has_work() or receiver.has_work():
            assert time.monotonic() < end, "decode side did not settle"
            drive_decode(engine, receiver, client.replies, time.monotonic())
            time.sleep(0.0005)
        assert receiver.stats.loaded == 4 and receiver.stats.fence_failures == 0
        for rid, remote in leases.items():
            assert torch.equal(runner.seen[rid][: len(remote)], p_kv[remote]), rid
        with lock:
            assert table.stats.released == {"done": 4}
    finally:
        client.close()
        tr.close()


def test_a_decode_engine_in_bfloat16_is_refused_at_hello_naming_both_dtypes(
    prefill,  # type: ignore[no-untyped-def]
) -> None:
    server = prefill[0]
    theirs = KvGeometry(architecture="fake", num_layers=2, num_kv_heads=2, head_dim=16,
                        block_size=4, dtype="bfloat16")
    client = RelayClient(compat=theirs.compat_hash(), transport="tcp", client_id="d-2",
                         kv_dtype=theirs.dtype)
    try:
        with pytest.raises(RelayUnavailable) as err:
            client.open(server.address)
    finally:
        client.close()
    text = str(err.value)
    assert "fp8_e4m3" in text and "bfloat16" in text and "--kv-cache-dtype" in text, text
