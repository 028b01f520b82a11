"""One engine of a prefill/decode pair as a real process, driven by JSON lines on stdin.

    python tests/e2e/relay_node.py prefill --acquire-timeout 1.5
           [--secret S --max-connections N --max-per-address N --handshake-timeout S
            --frame-timeout S --idle-timeout S]   (the relay server's bounds)
        -> prints {"relay": "127.0.0.1:PORT", "shm": segment name}; then per line:
           {"op": "prefill", "rid", "prompt", "max_tokens", "seed"} -> kv_transfer_params
           {"op": "stats"} -> pool, lease and relay server figures
    python tests/e2e/relay_node.py decode --transport shm|tcp [--stall]
    (both: --model DIR runs the real model runner of kvrelay.model instead)
        -> prints {"ready": true}; then per line:
           {"op": "decode", "items": [{"rid", "prompt", "max_tokens", "seed", "kv"}]}
           -> {"outputs": {rid: tokens 2..n}, "stats": {...}}

Engines use the TensorFakeRunner over a real KV tensor (the prefill engine's in shared
memory), so the decode engine verifies, before its first sample, that every byte of
the prompt's KV arrived. ``--stall`` (tcp): each transfer receives its first block and
hangs: a decode engine to kill -9 in the middle of a transfer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from typing import Any

import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.relay.client import RelayClient
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.receiver import Receiver, ReceiverConfig, RemoteKv
from kvrelay.relay.server import RelayServer, RelayServerConfig
from kvrelay.relay.transports import tcp
from kvrelay.relay.transports.base import byte_view
from kvrelay.relay.transports.shm import ShmKvCache, ShmTransport
from kvrelay.relay.transports.tcp import TcpTransport
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.kv import TINY_GEOMETRY, TensorFakeRunner, drive_decode, kv_shape

GEOM = TINY_GEOMETRY
COMPAT = GEOM.compat_hash()
NBLOCKS = 256
VOCAB = 1000
MODEL_BLOCK = 4


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def params(item: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=item["max_tokens"], seed=item["seed"], temperature=0.0,
                          ignore_eos=True)


def make_runner(args: argparse.Namespace, pool: BlockPool,
                factory: Any = None) -> tuple[Any, torch.Tensor, str, SchedulerConfig]:
    """(runner, kv cache, compat hash, scheduler config): the fake runner over a tiny
    KV tensor, or with ``--model`` the real model runner (kvrelay.model)."""
    if args.model:
        from kvrelay.model import load_model

        m = load_model(args.model, num_blocks=NBLOCKS, block_size=MODEL_BLOCK,
                       kv_cache_factory=factory)
        cfg = SchedulerConfig(num_blocks=NBLOCKS, block_size=MODEL_BLOCK,
                              max_model_len=m.max_model_len)
        return m.runner, m.kv_cache, m.kv_geometry.compat_hash(), cfg
    shape = kv_shape(GEOM, NBLOCKS)
    kv = factory(shape, torch.float32) if factory else torch.zeros(shape)
    cfg = SchedulerConfig(num_blocks=NBLOCKS, block_size=GEOM.block_size)
    return TensorFakeRunner(kv, pool=pool, vocab_size=VOCAB), kv, COMPAT, cfg


def run_prefill(args: argparse.Namespace) -> None:
    shm = ShmKvCache()
    pool = BlockPool(NBLOCKS)
    runner, kv, compat, sched = make_runner(args, pool, shm.factory)
    lock = threading.Lock()
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id=f"p-{time.time_ns()}",
                       acquire_timeout=args.acquire_timeout, hard_cap=60.0)
    cfg = RelayServerConfig(
        compat=compat, transports={"shm": shm.descriptor(), "tcp": {}},
        secret=args.secret.encode() if args.secret else None,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_per_address,
        handshake_timeout=args.handshake_timeout, frame_timeout=args.frame_timeout,
        idle_timeout=args.idle_timeout,
    )
    server = RelayServer(table, lock, cfg, kv_bytes=byte_view(kv)).start()
    engine = Engine(sched, runner, pool=pool, kv_handoff=server.kv_handoff)
    emit({"relay": server.address, "shm": shm.descriptor()["name"]})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "prefill":
                with lock:
                    engine.add_request(cmd["rid"], cmd["prompt"], params(cmd),
                                       remote_decode=True)
                    for _ in range(10_000):
                        if not engine.has_work():
                            break
                        engine.step()
                    got = server.kv_params.pop(cmd["rid"], None)
                    emit(got.to_dict() if got else {"error": "prefill did not finish"})
            elif cmd["op"] == "stats":
                with lock:
                    emit({"free": pool.num_free, "total": NBLOCKS,
                          "leases": table.leases_by_state(),
                          "released": table.stats.released,
                          "server": {**dataclasses.asdict(server.stats),
                                     "open": server.open_connections}})
    finally:
        server.close()
        shm.close()


def stall_mid_stream() -> None:
    """The tcp transport receives the first block's bytes, then hangs: a decode
    engine to kill -9 in the middle of a byte stream."""
    real = tcp.recv_blocks

    def recv_then_hang(sock: Any, kv_bytes: Any, block_ids: Any, cancelled: Any) -> None:
        real(sock, kv_bytes, list(block_ids)[:1], cancelled)
        sys.stdout.write(json.dumps({"stalled": True}) + "\n")
        sys.stdout.flush()
        threading.Event().wait()

    tcp.recv_blocks = recv_then_hang  # type: ignore[assignment]


def run_decode(args: argparse.Namespace) -> None:
    pool = BlockPool(NBLOCKS)
    runner, kv, compat, sched = make_runner(args, pool)
    engine = Engine(sched, runner, pool=pool)
    holder = f"d-{time.time_ns()}"  # the relay binds lease messages to HELLO's client_id
    client = RelayClient(compat=compat, transport=args.transport, client_id=holder)
    transport: Any
    if args.stall:
        stall_mid_stream()
    if args.transport == "shm":
        transport = ShmTransport(kv)
    else:
        transport = TcpTransport(kv, connect=client.open_data)
    rx = Receiver(EngineKvLoads(engine), client, transport, holder=holder,
                  compat=compat,
                  config=ReceiverConfig(rto=0.5, peer_timeout=5.0, heartbeat_interval=0.3))
    emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        outputs: dict[str, list[int]] = {}
        for item in cmd["items"]:
            rx.submit(item["rid"], item["prompt"], params(item),
                      RemoteKv.from_dict(item["kv"]), time.monotonic())
        while engine.has_work() or rx.has_work():
            for o in drive_decode(engine, rx, client.replies, time.monotonic()):
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            time.sleep(0.0002)
        emit({"outputs": outputs, "stats": {"loaded": rx.stats.loaded,
                                            "fallbacks": rx.stats.fallbacks,
                                            "bytes": rx.stats.transfer_bytes,
                                            "free": pool.num_free}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--acquire-timeout", type=float, default=30.0)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--stall", action="store_true")
    ap.add_argument("--model", default=None, help="a model directory for kvrelay.model")
    ap.add_argument("--secret", default=None)
    ap.add_argument("--max-connections", type=int, default=256)
    ap.add_argument("--max-per-address", type=int, default=64)
    ap.add_argument("--handshake-timeout", type=float, default=5.0)
    ap.add_argument("--frame-timeout", type=float, default=5.0)
    ap.add_argument("--idle-timeout", type=float, default=120.0)
    args = ap.parse_args()
    run_prefill(args) if args.role == "prefill" else run_decode(args)


if __name__ == "__main__":
    main()
