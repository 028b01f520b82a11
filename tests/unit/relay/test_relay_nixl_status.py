"""The nixl transport's status handling against a fake NIXL agent (issue 21).

NIXL reports an error for a READ as soon as one of its parts fails, while the other
parts may still be landing (its UCX backend returns the first failed request's status),
and releasing a READ in flight does not stop its writes. So a failed READ is not final
until NIXL says the whole READ completed: until then its blocks are quarantined, never
reused. The fake stands in for NIXL's native agent only (no NIXL needed); the relay
server, the receiver, the engine and its pool are the real ones.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

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
from kvrelay.relay.transports.base import PeerInfo, TransferState, byte_view
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import expected_output
from kvrelay.testing.kv import TINY_GEOMETRY, TensorFakeRunner, drive_decode, kv_shape

pytestmark = pytest.mark.timeout(60)

GEOM = TINY_GEOMETRY
COMPAT = GEOM.compat_hash()
NBLOCKS = 64
VOCAB = 1000
OK, IN_PROG, ERR = "NIXL_SUCCESS", "NIXL_IN_PROG", "NIXL_ERR_REMOTE_DISCONNECT"


class NixlBackendError(Exception):
    pass


NixlBackendError.__module__ = "nixl._bindings"  # as NIXL's own exceptions are


class FakeNativeAgent:
    """NIXL's native agent as far as the transport uses it; ``statuses`` scripts what
    getXferStatus answers (the last one repeats; an exception is raised)."""

    def __init__(self) -> None:
        self.statuses: list[Any] = [IN_PROG]
        self.post_status: Any = IN_PROG
        self.posted: list[int] = []
        self.released: list[int] = []
        self.status_calls = 0
        self.xfer_us = 0  # NIXL's telemetry of a READ (xferDuration, microseconds)

    def createXferReq(self, op: str, ldl: Any, rdl: Any, agent: str, notif: bytes,
                      backends: list[Any]) -> int:
        return 100 + len(self.posted)

    def postXferReq(self, handle: int, notif: bytes) -> Any:
        self.posted.append(handle)
        if isinstance(self.post_status, Exception):
            raise self.post_status
        return self.post_status

    def getXferStatus(self, handle: int) -> Any:
        self.status_calls += 1
        st = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if isinstance(st, Exception):
            raise st
        return st

    def getXferTelemetry(self, handle: int) -> Any:
        return SimpleNamespace(xferDuration=self.xfer_us, postDuration=self.xfer_us)

    def releaseXferReq(self, handle: int) -> None:
        self.released.append(handle)

    def loadRemoteMD(self, metadata: bytes) -> bytes:
        return b"p-agent"

    def invalidateRemoteMD(self, name: str) -> None:
        pass

    def deregisterMem(self, descs: Any, backends: list[Any]) -> None:
        pass


def fake_transport(kv: torch.Tensor) -> tuple[nixl.NixlTransport, FakeNativeAgent]:
    native = FakeNativeAgent()
    agent = object.__new__(nixl.NixlAgent)  # the real wrapper, over the fake native one
    agent.b = SimpleNamespace(NIXL_SUCCESS=OK, NIXL_IN_PROG=IN_PROG, NIXL_READ="READ",
                              DRAM_SEG="DRAM", VRAM_SEG="VRAM",
                              nixlXferDList=lambda mem, rows: rows)
    agent.name, agent.lock, agent.agent = "d-agent", threading.Lock(), native
    agent.mems, agent._regs = {"DRAM": "DRAM", "VRAM": "VRAM"}, []
    t = nixl.NixlTransport()
    t.agent, t.kv_cache, t.local = agent, kv, nixl.regions_of(kv)
    return t, native


def descriptor(kv: torch.Tensor) -> dict[str, Any]:
    r = nixl.regions_of(kv)
    return {"agent": "p-agent", "metadata": b"md", "addr": 1 << 20,
            "nbytes": r.num_blocks * r.piece_bytes, "regions": [1 << 20],
            "num_blocks": r.num_blocks, "piece_bytes": r.piece_bytes, "dev": 0, "mem": "DRAM",
            "block_bytes": r.block_bytes}


@pytest.mark.parametrize("failure", ["error status", "exception", "post refused",
                                     "post raised"])
def test_a_failed_read_is_not_final_until_nixl_says_it_ended(failure: str) -> None:
    """Bug (issue 21): any exception from getXferStatus, or any status but in-progress,
    made the READ FAILED and final at once (and released it), though a multi-part READ
    with one failed part may still be landing."""
    kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
    t, native = fake_transport(kv)
    boom = NixlBackendError("remote disconnect")
    native.statuses = {"error status": [ERR, ERR, IN_PROG, OK], "exception": [boom, IN_PROG, OK],
                       "post refused": [IN_PROG, IN_PROG, OK],
                       "post raised": [IN_PROG, IN_PROG, OK]}[failure]
    native.post_status = {"post refused": ERR, "post raised": boom}.get(failure, IN_PROG)
    h = t.read(PeerInfo("p:1", "p-1", descriptor(kv)), "L", "d", [0, 1, 2], [5, 6, 7])
    seen = [t.poll(h) for _ in range(len(native.statuses) - 1)]
    assert all(st.state is TransferState.PENDING for st in seen), seen
    assert all("nixl transfer failed" in st.error for st in seen), seen
    assert native.released == []  # never released (and given up) while it may write
    final = t.poll(h)  # NIXL: the whole READ completed
    assert final.state is TransferState.FAILED and "nixl transfer failed" in final.error
    assert native.released == native.posted
    assert t.poll(h) is final


def test_a_clean_read_is_done_and_released() -> None:
    kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
    t, native = fake_transport(kv)
    native.statuses = [IN_PROG, OK]
    h = t.read(PeerInfo("p:1", "p-1", descriptor(kv)), "L", "d", [0, 1], [5, 6])
    st = t.poll(h)
    assert st.state is TransferState.PENDING and not st.error
    assert t.poll(h).state is TransferState.DONE and native.released == native.posted


def test_a_read_completed_within_its_post_is_done_at_once_by_nixls_clock() -> None:
    """UCX over cma copies inside postXferReq, which then answers NIXL_SUCCESS: the READ
    is final there, released, with no status call (polling for it cost the receiver a
    turn of its loop, its lock and NIXL's: milliseconds on a core vLLM keeps busy), and
    it carries NIXL's own clock of the copy, the figure NixlConnector reports."""
    kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
    t, native = fake_transport(kv)
    native.post_status, native.statuses = OK, [IN_PROG]  # asking would say in progress
    native.xfer_us = 4200
    h = t.read(PeerInfo("p:1", "p-1", descriptor(kv)), "L", "d", [0, 1], [5, 6])
    st = t.poll(h)
    assert st.state is TransferState.DONE and native.released == native.posted
    assert native.status_calls == 0
    assert st.own_seconds == pytest.approx(0.0042)


def test_blocks_of_a_failed_read_are_quarantined_until_nixl_says_it_ended() -> None:
    """The receiver falls back at once (the request recomputes on fresh blocks and
    answers the colocated tokens) while the failed READ's blocks stay quarantined
    (kvrelay_kv_quarantined_blocks); they return to the pool only once NIXL reports the
    READ complete."""
    p_kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
    p_pool, lock = BlockPool(NBLOCKS), threading.Lock()
    table = LeaseTable(PoolLeaseBlocks(p_pool), engine_id="p-1", acquire_timeout=5.0,
                       hard_cap=60.0)
    cfg = RelayServerConfig(compat=COMPAT, transports={"nixl": descriptor(p_kv), "tcp": {}})
    server = RelayServer(table, lock, cfg, kv_bytes=byte_view(p_kv)).start()
    sched = SchedulerConfig(num_blocks=NBLOCKS, block_size=GEOM.block_size)
    p_engine = Engine(sched, TensorFakeRunner(p_kv, pool=p_pool, vocab_size=VOCAB),
                      pool=p_pool, kv_handoff=server.kv_handoff)
    d_kv, d_pool = torch.zeros(kv_shape(GEOM, NBLOCKS)), BlockPool(NBLOCKS)
    d_engine = Engine(sched, TensorFakeRunner(d_kv, pool=d_pool, vocab_size=VOCAB),
                      pool=d_pool)
    client = RelayClient(compat=COMPAT, transport="nixl", client_id="d-1")
    t, native = fake_transport(d_kv)
    native.statuses = [ERR]  # one part failed; NIXL does not say the rest ended
    rx = Receiver(EngineKvLoads(d_engine), client, t, holder="d-1", compat=COMPAT,
                  config=ReceiverConfig(rto=0.2, peer_timeout=2.0))
    try:
        prompt, params = list(range(1, 14)), SamplingParams(max_tokens=5, seed=3)
        with lock:
            p_engine.add_request("r", prompt, params, remote_decode=True)
            while p_engine.has_work():
                p_engine.step()
            kv = RemoteKv.from_dict(server.kv_params.pop("r").to_dict())
        rx.submit("r", prompt, params, kv, time.monotonic())
        out: list[int] = []
        end = time.monotonic() + 10.0
        while d_engine.has_work():
            assert time.monotonic() < end, "the request did not finish"
            for o in drive_decode(d_engine, rx, client.replies, time.monotonic()):
                out.extend(o.new_token_ids)
            time.sleep(0.0005)
        assert [kv.first_token, *out] == expected_output(3, len(prompt), 5, VOCAB)
        assert rx.stats.fallbacks == {"transfer_failed": 1}
        n = len(kv.block_ids)
        assert rx.stats.quarantined_blocks == n and d_pool.num_free == NBLOCKS - n
        assert native.released == []
        native.statuses = [OK]  # NIXL: the READ ended
        rx.tick(time.monotonic())
        assert rx.stats.quarantined_blocks == 0 and d_pool.num_free == NBLOCKS
        assert native.released == native.posted and not rx.has_work()
        end = time.monotonic() + 5.0
        while p_pool.num_free != NBLOCKS:  # D told P the outcome (RELEASE failed)
            assert time.monotonic() < end, "P's lease was not released"
            time.sleep(0.01)
    finally:
        client.close()
        server.close()
