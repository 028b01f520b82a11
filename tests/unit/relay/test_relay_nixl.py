"""The nixl transport: real NIXL agents (UCX on CPU memory) behind a real relay server.

Prefill and decode engines in one process, as in test_relay_roundtrip.py: the HELLO
reply carries P's NIXL metadata, D reads the lease's blocks with one-sided READs, the
fence commits, and the fake runner verifies every KV value D decodes on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.receiver import Receiver, ReceiverConfig, RemoteKv
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.base import PeerInfo, TransferState, TransferStatus, byte_view
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import expected_output
from kvrelay.testing.kv import TINY_GEOMETRY, TensorFakeRunner, drive_decode, kv_shape

pytestmark = pytest.mark.skipif(not nixl.available(), reason=nixl.INSTALL_HINT)

GEOM = TINY_GEOMETRY
COMPAT = GEOM.compat_hash()
NBLOCKS = 64
VOCAB = 1000


def wait(tr: nixl.NixlTransport, h: nixl.NixlHandle, seconds: float = 10.0) -> TransferStatus:
    end = time.monotonic() + seconds
    while (st := tr.poll(h)).state is TransferState.PENDING:
        assert time.monotonic() < end, "the nixl read did not finish"
        time.sleep(0.0005)
    return st


def hello_roundtrip(descriptor: dict) -> dict:
    """The descriptor as D gets it: through the relay's msgpack HELLO reply."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(descriptor))


@pytest.fixture(scope="module")
def caches() -> Iterator[tuple[torch.Tensor, nixl.NixlTransport, dict]]:
    src = torch.randn(kv_shape(GEOM, NBLOCKS))
    p = nixl.NixlTransport()
    desc = hello_roundtrip(p.register(src))
    yield src, p, desc
    p.close()


def test_runs_of_blocks_become_one_descriptor_each_and_land_right(caches: tuple) -> None:
    src, _, desc = caches
    dst = torch.zeros_like(src)
    d = nixl.NixlTransport(dst)
    try:
        remote, local = [3, 4, 5, 10, 11, 40, 2], [7, 8, 9, 1, 2, 60, 30]
        h = d.read(PeerInfo("p:1", "p", desc), "L", "d", remote, local)
        assert h.descriptors == 4  # 3-5 -> 7-9, 10-11 -> 1-2, 40 -> 60, 2 -> 30
        st = wait(d, h)
        assert st.state is TransferState.DONE, st.error
        assert st.nbytes == len(local) * byte_view(dst).shape[1]
        for r, lb in zip(remote, local, strict=True):
            assert torch.equal(dst[lb], src[r])
        untouched = [b for b in range(NBLOCKS) if b not in local]
        assert not dst[untouched].any(), "a block outside the read was written"
    finally:
        d.close()


def test_bad_descriptors_fail_with_a_clear_error_and_write_nothing(caches: tuple) -> None:
    src, _, desc = caches
    dst = torch.zeros_like(src)
    d = nixl.NixlTransport(dst)
    try:
        for bad, msg in (({**desc, "block_bytes": 8}, "block of 8 bytes"),
                         ({k: v for k, v in desc.items() if k != "metadata"}, "lacks")):
            h = d.read(PeerInfo("p:1", "p", bad), "L", "d", [1], [1])
            st = d.poll(h)
            assert st.state is TransferState.FAILED and msg in st.error
        h = d.read(PeerInfo("p:1", "p", desc), "L", "d", [NBLOCKS], [1])
        assert "outside the KV cache" in d.poll(h).error
        assert not dst.any()
    finally:
        d.close()


def test_cancel_before_the_read_is_posted_never_writes(caches: tuple,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src, _, desc = caches
    monkeypatch.setenv("KVRELAY_FAULT_TRANSFER_DELAY_S", "30")
    dst = torch.zeros_like(src)
    d = nixl.NixlTransport(dst)
    try:
        h = d.read(PeerInfo("p:1", "p", desc), "L", "d", [1, 2], [1, 2])
        assert d.poll(h).state is TransferState.PENDING
        d.cancel(h)
        st = d.poll(h)
        assert st.state is TransferState.FAILED and "cancelled" in st.error
        assert h.xfer is None and not dst.any()
    finally:
        d.close()


def test_a_cancelled_read_in_flight_is_failed_only_once_it_stopped_writing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over UCX tcp a READ is asynchronous: cancelled right after its post, it must stay
    PENDING until NIXL says it ended. (Releasing it in flight was accepted by NIXL while
    bytes kept landing: the receiver would have freed blocks still being written.)"""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when the agents' backends are created
    src = torch.ones(256, 65536)
    dst = torch.zeros_like(src)
    p, d = nixl.NixlTransport(), nixl.NixlTransport(dst)
    try:
        peer = PeerInfo("p:1", "p", hello_roundtrip(p.register(src)))
        assert wait(d, d.read(peer, "L", "d", [0], [0])).state is TransferState.DONE
        # A READ can end inside its post or before the first poll (more often since
        # UCX_USE_MT_MUTEX made copies faster): try until two were cancelled in flight.
        in_flight_seen = 0
        for _ in range(20):
            if in_flight_seen == 2:
                break
            dst.zero_()
            h = d.read(peer, "L", "d", list(range(1, 256)), list(range(1, 256)))
            in_flight = d.poll(h).state is TransferState.PENDING
            d.cancel(h)
            st = wait(d, h)
            # A READ that completed between the poll and the cancel is DONE; either way
            # the handle no longer writes once it is not PENDING.
            assert st.state is TransferState.DONE or (
                st.state is TransferState.FAILED and "cancelled" in st.error), st
            snapshot = dst.clone()
            time.sleep(0.05)
            assert torch.equal(snapshot, dst), "the READ wrote after poll said FAILED"
            in_flight_seen += in_flight
        assert in_flight_seen, "the READ was never in flight: nothing was tested"
    finally:
        d.close()
        p.close()


def test_a_restarted_prefill_engine_is_a_new_agent_on_the_same_relay() -> None:
    dst = torch.zeros(kv_shape(GEOM, NBLOCKS))
    d = nixl.NixlTransport(dst)
    try:
        for gen in range(2):
            src = torch.full(kv_shape(GEOM, NBLOCKS), float(gen + 1))
            p = nixl.NixlTransport()
            try:
                desc = hello_roundtrip(p.register(src))
                h = d.read(PeerInfo("p:1", f"p{gen}", desc), "L", "d", [5], [6])
                assert wait(d, h).state is TransferState.DONE
                assert torch.equal(dst[6], src[5])
                assert d._remotes == {"p:1": desc["agent"]}
            finally:
                p.close()
    finally:
        d.close()


class Pair:
    """P (relay server offering nixl) and D (receiver reading with nixl), one process."""

    def __init__(self) -> None:
        self.p_kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
        self.p_pool = BlockPool(NBLOCKS)
        self.lock = threading.Lock()
        self.table = LeaseTable(PoolLeaseBlocks(self.p_pool), engine_id="p-1", acquire_timeout=5.0,
                                hard_cap=60.0)
        self.p_nixl = nixl.NixlTransport()
        cfg = RelayServerConfig(compat=COMPAT, transports={
            "nixl": self.p_nixl.register(self.p_kv), "tcp": {}})
        self.server = RelayServer(self.table, self.lock, cfg,
                                  kv_bytes=byte_view(self.p_kv)).start()
        self.p_engine = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=GEOM.block_size),
                               TensorFakeRunner(self.p_kv, pool=self.p_pool, vocab_size=VOCAB),
                               pool=self.p_pool, kv_handoff=self.server.kv_handoff)
        self.d_kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
        self.d_pool = BlockPool(NBLOCKS)
        self.d_engine = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=GEOM.block_size),
                               TensorFakeRunner(self.d_kv, pool=self.d_pool, vocab_size=VOCAB),
                               pool=self.d_pool)
        self.client = RelayClient(compat=COMPAT, transport="nixl", client_id="d-1")
        self.d_nixl = nixl.NixlTransport(self.d_kv)
        self.receiver = Receiver(EngineKvLoads(self.d_engine), self.client, self.d_nixl,
                                 holder="d-1", compat=COMPAT,
                                 config=ReceiverConfig(rto=0.2, peer_timeout=2.0))

    def prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> RemoteKv:
        with self.lock:
            self.p_engine.add_request(rid, prompt, params, remote_decode=True)
            while self.p_engine.has_work():
                self.p_engine.step()
            return RemoteKv.from_dict(self.server.kv_params.pop(rid).to_dict())

    def run(self, deadline_s: float = 15.0) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        end = time.monotonic() + deadline_s
        while self.d_engine.has_work() or self.receiver.has_work():
            assert time.monotonic() < end, "decode side did not settle"
            for o in drive_decode(self.d_engine, self.receiver, self.client.replies,
                                  time.monotonic()):
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            time.sleep(0.0005)
        return out

    def close(self) -> None:
        self.client.close()
        self.d_nixl.close()
        self.server.close()
        self.p_nixl.close()


def test_handover_over_nixl_matches_colocated_and_frees_everything() -> None:
    pair = Pair()
    try:
        expect: dict[str, list[int]] = {}
        for i in range(6):
            prompt = list(range(1, 3 + 7 * i))
            params = SamplingParams(max_tokens=6, seed=200 + i)
            kv = pair.prefill(f"r{i}", prompt, params)
            expect[f"r{i}"] = expected_output(200 + i, len(prompt), 6, VOCAB)
            pair.receiver.submit(f"r{i}", prompt, params, kv, time.monotonic())
        got = pair.run()
        for rid, toks in expect.items():
            assert [toks[0], *got[rid]] == toks
        st = pair.receiver.stats
        assert st.loaded == 6 and st.fence_failures == 0 and not st.fallbacks
        assert sum(st.transfer_seconds_buckets) == 6 and st.transfer_bytes > 0
        with pair.lock:
            assert pair.p_pool.num_free == NBLOCKS
            assert pair.table.stats.released == {"done": 6}
        assert pair.d_pool.num_free == NBLOCKS
        assert pair.server.stats.bytes_sent == 0  # nothing went over the relay's tcp path
    finally:
        pair.close()


@pytest.mark.parametrize("operator", [None, "n"])
def test_ucx_guards_its_worker_with_a_mutex_unless_the_operator_says_otherwise(
        monkeypatch: pytest.MonkeyPatch, operator: str | None) -> None:
    """With UCX's default spinlock, D's progress thread spun through every READ that
    copies inside its post (cma), on the core doing the copy: twice the READ's time
    (bench/nixl_micro.py, issue 20). The agent starts its UCX backend with
    UCX_USE_MT_MUTEX=y; an operator's own setting wins."""
    if operator is None:
        monkeypatch.delenv("UCX_USE_MT_MUTEX", raising=False)
    else:
        monkeypatch.setenv("UCX_USE_MT_MUTEX", operator)
    agent = nixl.NixlAgent(f"mutex-test-{operator}")
    try:
        assert os.environ.get("UCX_USE_MT_MUTEX") == (operator or "y")
    finally:
        agent.close()
