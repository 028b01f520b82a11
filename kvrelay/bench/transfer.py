"""`kvrelay bench transfer`: one request's KV through each transport, against a reference.

The request: 2,048 tokens of the embedded model's geometry (30 layers, 3 KV heads,
head_dim 64, bf16, block 16: 128 blocks of 368,640 bytes, 47 MB), its blocks
scattered at random in a large cache on both sides. Each transport moves it
``--repeats`` times; in the same run the same number of bytes moves through the
reference: ``shm`` against a numpy copy of one contiguous buffer, ``tcp`` against a
raw socket stream of one contiguous buffer over loopback. Medians are compared.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("transfer", help="KV transfer bandwidth of shm and tcp")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--cache-blocks", type=int, default=768, help="blocks in each cache")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def same_bits(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


@dataclass
class Timing:
    best: float
    median: float


def paired(fn: Callable[[], None], ref: Callable[[], None], repeats: int,
           prepare: Callable[[], None] | None = None) -> tuple[Timing, Timing]:
    """Seconds of ``fn`` and ``ref``, run alternately so that both see the same load
    on a shared machine. One warm-up round each (page faults, connections).
    ``prepare`` runs, untimed, before each call of ``fn``."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats + 1):
        for f, out in ((fn, times[0]), (ref, times[1])):
            if prepare is not None and f is fn:
                prepare()
            t0 = time.perf_counter()
            f()
            if i:
                out.append(time.perf_counter() - t0)
    a, b = times
    return (Timing(min(a), statistics.median(a)), Timing(min(b), statistics.median(b)))


def run(args: argparse.Namespace) -> int:
    import contextlib

    import numpy as np
    import torch

    from kvrelay.model.interface import KvGeometry
    from kvrelay.relay.transports.shm import ShmKvCache

    geom = KvGeometry(architecture="llama", num_layers=30, num_kv_heads=3, head_dim=64,
                      block_size=16, dtype="bfloat16")
    nblocks = -(-args.tokens // geom.block_size)
    shape = (args.cache_blocks, geom.num_layers, 2, geom.block_size, geom.num_kv_heads,
             geom.head_dim)
    rng = random.Random(args.seed)
    remote = rng.sample(range(args.cache_blocks), nblocks)
    local = rng.sample(range(args.cache_blocks), nblocks)
    nbytes = nblocks * geom.block_bytes
    ref_src = np.ones(nbytes, dtype=np.uint8)
    ref_dst = np.zeros(nbytes, dtype=np.uint8)

    shm = ShmKvCache()
    with contextlib.ExitStack() as stack:
        src = shm.factory(shape, torch.bfloat16)
        stack.callback(shm.close)
        src.view(torch.int16).random_(-30000, 30000)
        dst = torch.zeros(shape, dtype=torch.bfloat16)
        shm_once = shm_reader(shm, dst, remote, local, stack)
        shm_s, memcpy_s = paired(shm_once, lambda: np.copyto(ref_dst, ref_src), args.repeats)
        check(dst, src, local, remote, "shm")
        dst.zero_()
        tcp_once, new_lease = tcp_reader(geom.compat_hash(), src, dst, remote, local, stack)
        sock_once = socket_streamer(ref_src, ref_dst, args.repeats + 1, stack)
        tcp_s, sock_s = paired(tcp_once, sock_once, args.repeats, prepare=new_lease)
        check(dst, src, local, remote, "tcp")

    print(f"KV of {args.tokens} tokens: {nblocks} blocks x {geom.block_bytes:,} B = "
          f"{nbytes / 1e6:.1f} MB, scattered in caches of {args.cache_blocks} blocks; "
          f"{args.repeats} rounds, each path alternating with its reference")
    print(f"{'path':<28}{'GB/s best':>10}{'ms best':>9}{'ms median':>11}")
    table = [("shm transport", shm_s), ("numpy memcpy (contiguous)", memcpy_s),
             ("tcp transport", tcp_s), ("socket stream (contiguous)", sock_s)]
    for name, t in table:
        print(f"{name:<28}{nbytes / t.best / 1e9:>10.2f}{t.best * 1e3:>9.2f}"
              f"{t.median * 1e3:>11.2f}")
    # Ratios of the best rounds: the least disturbed by other load on the machine.
    print(f"transfer ratios shm/memcpy: {memcpy_s.best / shm_s.best:.2f} "
          f"tcp/socket: {sock_s.best / tcp_s.best:.2f}")
    return 0


def check(dst: Any, src: Any, local: list[int], remote: list[int], name: str) -> None:
    import torch

    for lb, rb in zip(local, remote, strict=True):
        if not torch.equal(dst[lb].view(torch.int16), src[rb].view(torch.int16)):
            raise AssertionError(f"the {name} transport copied block {rb} -> {lb} wrongly")


def shm_reader(shm: Any, dst: Any, remote: list[int], local: list[int],
               stack: Any) -> Callable[[], None]:
    from kvrelay.relay.transports.base import PeerInfo, TransferState
    from kvrelay.relay.transports.shm import ShmTransport

    tr = ShmTransport(dst, threaded=False)
    stack.callback(tr.close)
    peer = PeerInfo("local", "bench", shm.descriptor())

    def once() -> None:
        h = tr.read(peer, "lease", "bench", remote, local)
        assert tr.poll(h).state is TransferState.DONE, tr.poll(h).error

    return once


def tcp_reader(compat: str, src: Any, dst: Any, remote: list[int], local: list[int],
               stack: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """A real relay server; the tcp transport reads a real lease. Returns the timed
    read and the untimed preparation of a fresh lease over the same blocks (the
    relay streams each block of a lease once: the READ byte budget)."""
    from kvrelay.core.block_pool import BlockPool, request_owner
    from kvrelay.core.kv_port import PoolLeaseBlocks
    from kvrelay.relay.client import RelayClient
    from kvrelay.relay.lease import LeaseTable
    from kvrelay.relay.server import RelayServer, RelayServerConfig
    from kvrelay.relay.transports.base import TransferState, byte_view
    from kvrelay.relay.transports.tcp import TcpTransport

    pool = BlockPool(src.shape[0])
    pool.allocate(src.shape[0], "req:filler")
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id="bench-p", acquire_timeout=600.0,
                       hard_cap=600.0)
    lock = threading.Lock()
    server = RelayServer(table, lock, RelayServerConfig(compat=compat, transports={"tcp": {}}),
                         kv_bytes=byte_view(src), clock=lambda: 0.0).start()
    stack.callback(server.close)
    client = RelayClient(compat=compat, transport="tcp", client_id="bench-d")
    stack.callback(client.close)
    tr = TcpTransport(dst, connect=client.open_data)
    stack.callback(tr.close)
    peer = client.peer(server.address)
    current: list[str] = []

    def new_lease() -> None:
        with lock:
            if current:  # free the blocks (the only free ones), then lease them again
                table.abort("bench-p", current.pop(), 0.0)
                pool.allocate(len(remote), request_owner("bench"))
            else:
                pool.transfer(remote, "req:filler", request_owner("bench"))
            lease = table.create("bench", remote, 0.0, num_tokens=0, first_token=0)
            table.acquire("bench-p", lease.lease_id, "bench-d", "bench", 0.0)
            current.append(lease.lease_id)

    def once() -> None:
        h = tr.read(peer, current[-1], "bench-d", remote, local, attempt="bench")
        assert h.thread is not None
        h.thread.join()
        assert tr.poll(h).state is TransferState.DONE, tr.poll(h).error

    return once, new_lease


def socket_streamer(src: Any, dst: Any, rounds: int, stack: Any) -> Callable[[], None]:
    """The reference: one persistent loopback connection streaming one contiguous
    buffer per round into one contiguous buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    stack.callback(listener.close)
    go = threading.Semaphore(0)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(rounds):
                go.acquire()
                conn.sendall(memoryview(src.data))

    threading.Thread(target=serve, daemon=True).start()
    sock = socket.create_connection(listener.getsockname()[:2])
    stack.callback(sock.close)
    view = memoryview(dst.data)

    def once() -> None:
        go.release()
        got = 0
        while got < len(view):
            k = sock.recv_into(view[got:], len(view) - got)
            if k == 0:
                raise ConnectionError("reference stream closed")
            got += k

    return once


if __name__ == "__main__":  # `python -m kvrelay.bench.transfer`, without the kvrelay CLI
    import sys

    parser = argparse.ArgumentParser(prog="kvrelay bench")
    register(parser.add_subparsers(dest="bench_command", required=True))
    sys.exit(run(parser.parse_args(["transfer", *sys.argv[1:]])))
