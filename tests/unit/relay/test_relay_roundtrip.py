"""Prefill and decode engines in one process, talking through a real relay server.

Threads and sockets on localhost: the protocol, both transports, the receiver's
fence and the engine hooks end to end, plus hostile peers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.relay import protocol as P
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.receiver import Receiver, ReceiverConfig, RemoteKv
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports.base import byte_view
from kvrelay.relay.transports.shm import ShmKvCache, ShmTransport
from kvrelay.relay.transports.tcp import TcpTransport
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import expected_output
from kvrelay.testing.kv import TINY_GEOMETRY, TensorFakeRunner, drive_decode, kv_shape

GEOM = TINY_GEOMETRY
COMPAT = GEOM.compat_hash()
NBLOCKS = 64
VOCAB = 1000


class Prefill:
    def __init__(self, secret: bytes | None = None, acquire_timeout: float = 5.0) -> None:
        self.shm = ShmKvCache()
        kv = self.shm.factory(kv_shape(GEOM, NBLOCKS), torch.float32)
        self.pool = BlockPool(NBLOCKS)
        self.lock = threading.Lock()
        self.table = LeaseTable(PoolLeaseBlocks(self.pool), engine_id="p-1",
                                acquire_timeout=acquire_timeout, hard_cap=60.0)
        cfg = RelayServerConfig(compat=COMPAT, secret=secret,
                                transports={"shm": self.shm.descriptor(), "tcp": {}})
        self.server = RelayServer(self.table, self.lock, cfg, kv_bytes=byte_view(kv)).start()
        self.engine = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=GEOM.block_size),
                             TensorFakeRunner(kv, pool=self.pool, vocab_size=VOCAB),
                             pool=self.pool, kv_handoff=self.server.kv_handoff)

    def prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> RemoteKv:
        with self.lock:
            self.engine.add_request(rid, prompt, params, remote_decode=True)
            while self.engine.has_work():
                self.engine.step()
            return RemoteKv.from_dict(self.server.kv_params.pop(rid).to_dict())

    def close(self) -> None:
        self.server.close()
        self.shm.close()


class Decode:
    def __init__(self, transport: str, secret: bytes | None = None,
                 config: ReceiverConfig | None = None) -> None:
        self.kv = torch.zeros(kv_shape(GEOM, NBLOCKS))
        self.pool = BlockPool(NBLOCKS)
        self.engine = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=GEOM.block_size),
                             TensorFakeRunner(self.kv, pool=self.pool, vocab_size=VOCAB),
                             pool=self.pool)
        self.client = RelayClient(compat=COMPAT, transport=transport.split("_")[0],
                                  client_id="d-1", secret=secret)
        # tcp_staged: the path of a cache on a GPU (staging.py), on CPU tensors.
        tr = (ShmTransport(self.kv) if transport == "shm"
              else TcpTransport(self.kv, connect=self.client.open_data,
                                staging=transport == "tcp_staged"))
        self.transport = tr
        self.receiver = Receiver(EngineKvLoads(self.engine), self.client, tr, holder="d-1",
                                 compat=COMPAT,
                                 config=config or ReceiverConfig(rto=0.2, peer_timeout=2.0))

    def run(self, deadline_s: float = 10.0) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        end = time.monotonic() + deadline_s
        while self.engine.has_work() or self.receiver.has_work():
            assert time.monotonic() < end, "decode side did not settle"
            for o in drive_decode(self.engine, self.receiver, self.client.replies,
                                  time.monotonic()):
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            time.sleep(0.0005)
        return out

    def close(self) -> None:
        self.client.close()
        self.transport.close()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    yield p
    p.close()


@pytest.mark.parametrize("transport", ["shm", "tcp", "tcp_staged"])
def test_handover_matches_colocated_and_frees_everything(prefill: Prefill, transport: str) -> None:
    d = Decode(transport)
    try:
        expect: dict[str, list[int]] = {}
        for i in range(6):
            prompt = list(range(1, 3 + 5 * i))
            params = SamplingParams(max_tokens=6, seed=100 + i)
            kv = prefill.prefill(f"r{i}", prompt, params)
            expect[f"r{i}"] = expected_output(100 + i, len(prompt), 6, VOCAB)
            assert kv.first_token == expect[f"r{i}"][0]
            d.receiver.submit(f"r{i}", prompt, params, kv, time.monotonic())
        got = d.run()
        for rid, toks in expect.items():
            assert [toks[0], *got[rid]] == toks
        assert d.receiver.stats.loaded == 6 and d.receiver.stats.fence_failures == 0
        with prefill.lock:
            assert prefill.pool.num_free == NBLOCKS
            assert prefill.table.stats.released == {"done": 6}
        assert d.pool.num_free == NBLOCKS
    finally:
        d.close()


def test_expired_lease_falls_back_to_recompute() -> None:
    p = Prefill(acquire_timeout=0.05)
    d = Decode("tcp")
    try:
        params = SamplingParams(max_tokens=4, seed=5)
        kv = p.prefill("r", [1, 2, 3, 4, 5], params)
        time.sleep(0.3)  # the expiry thread releases the lease
        d.receiver.submit("r", [1, 2, 3, 4, 5], params, kv, time.monotonic())
        got = d.run()
        assert [kv.first_token, *got["r"]] == expected_output(5, 5, 4, VOCAB)
        assert d.receiver.stats.fallbacks == {"acquire_failed": 1}
        with p.lock:
            assert p.pool.num_free == NBLOCKS and p.table.stats.released == {"expired": 1}
    finally:
        d.close()
        p.close()


def test_secret_is_required_and_checked() -> None:
    p = Prefill(secret=b"s3cret")
    try:
        good = RelayClient(compat=COMPAT, transport="tcp", client_id="d", secret=b"s3cret")
        assert good.peer(p.server.address).engine_id == "p-1"
        good.close()
        for secret in (None, b"wrong"):
            bad = RelayClient(compat=COMPAT, transport="tcp", client_id="d", secret=secret)
            with pytest.raises(ConnectionError, match="authenticated"):
                bad.open(p.server.address)
        assert p.server.stats.auth_failures == 2
    finally:
        p.close()


def test_hostile_frames_close_one_connection_and_the_server_keeps_serving(
    prefill: Prefill,
) -> None:
    host, port = prefill.server.address.split(":")
    payloads = [
        b"GET / HTTP/1.1\r\n\r\n",
        P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, 0, P.MAX_FRAME + 1),
        P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, 0, 3) + b"\xc1\xc1\xc1",
        P.encode(P.Acquire(1, "p-1", "x", "d", "a1")),  # a request before hello
    ]
    for payload in payloads:
        with socket.create_connection((host, int(port)), timeout=2.0) as s:
            assert isinstance(P.recv_frame(s), P.Challenge)
            s.sendall(payload)
            reply = P.recv_frame(s)
            assert isinstance(reply, P.Reply) and reply.status == "error"
            # closed: an orderly end, or a reset when our bytes were left unread
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b""
    wrong = RelayClient(compat="other", transport="tcp", client_id="d")
    with pytest.raises(ConnectionError, match="mismatch"):
        wrong.open(prefill.server.address)
    ok = RelayClient(compat=COMPAT, transport="shm", client_id="d")
    ok.send(prefill.server.address, P.Abort(7, "p-1", "nope", "d", "a1"))
    reply = ok.replies.get(timeout=2.0)
    assert reply.seq == 7 and reply.status == "error" and "unknown lease" in reply.error
    ok.close()
    assert prefill.server.stats.protocol_errors == 5


def test_unreachable_prefill_never_blocks_the_loop_and_falls_back() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    d = Decode("tcp", config=ReceiverConfig(rto=0.1, peer_timeout=0.5))
    try:
        params = SamplingParams(max_tokens=3, seed=4)
        kv = RemoteKv("L", dead, "p-9", [0, 1], 6, expected_output(4, 6, 3, VOCAB)[0], COMPAT)
        t0 = time.monotonic()
        d.receiver.submit("r", list(range(6)), params, kv, t0)
        d.client.send(dead, P.Abort(1, "p-9", "x", "d-1", "a1"))
        assert time.monotonic() - t0 < 0.1
        got = d.run(deadline_s=5.0)
        assert [kv.first_token, *got["r"]] == expected_output(4, 6, 3, VOCAB)
        assert d.receiver.stats.fallbacks == {"unreachable": 1}
    finally:
        d.close()
