"""`kvrelay bench transfer`: one request's KV through each transport, against a reference.

The request: 2,048 tokens of the embedded model's geometry (30 layers, 3 KV heads,
head_dim 64, bf16, block 16: 128 blocks of 368,640 bytes, 47 MB), its blocks
scattered at random in a large cache on both sides. Each transport moves it
``--repeats`` times, each round alternating with a reference moving the same bytes
as one contiguous buffer: ``shm`` against a numpy copy, ``tcp`` against a raw socket
stream, ``nixl`` against NIXL's own READ of one contiguous region (one descriptor),
both with the wire UCX chooses and with ``UCX_TLS=tcp``. With root, the same again
across two network namespaces joined by a veth pair (P's side in one, D's in the
other): tcp against a raw socket over the same veth, nixl against NIXL's raw READ.
Ratios (reference time / transport time) come from the best rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("transfer", help="KV transfer bandwidth of shm, tcp and nixl")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--cache-blocks", type=int, default=768, help="blocks in each cache")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="also run across two network namespaces (root; auto: when possible)")
    p.add_argument("--no-nixl", action="store_true", help="skip the nixl transport")
    p.add_argument("--kv-cache-dtype", default="bfloat16",
                   choices=["bfloat16", "float32", "fp8", "fp8_e4m3"],
                   help="the blocks' dtype: fp8 (fp8_e4m3) blocks hold head_dim codes and a "
                   "2-byte scale per token and head (default: %(default)s)")
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


@dataclass
class Row:
    name: str
    t: Timing
    ref_name: str
    ref: Timing


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from kvrelay.bench import netns
    from kvrelay.relay.geometry import KvGeometry
    from kvrelay.relay.transports import nixl
    from kvrelay.relay.transports.shm import ShmKvCache

    kv_dtype = "fp8_e4m3" if args.kv_cache_dtype == "fp8" else args.kv_cache_dtype
    geom = KvGeometry(architecture="llama", num_layers=30, num_kv_heads=3, head_dim=64,
                      block_size=16, dtype=kv_dtype, model_dtype="bfloat16")
    bf16_block = replace(geom, dtype="bfloat16").block_bytes  # what the ratio is against
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(kv_dtype,
                                                                             torch.uint8)
    nblocks = -(-args.tokens // geom.block_size)
    shape = (args.cache_blocks, geom.num_layers, 2, geom.block_size, geom.num_kv_heads,
             geom.head_elems)
    rng = random.Random(args.seed)
    remote = rng.sample(range(args.cache_blocks), nblocks)
    local = rng.sample(range(args.cache_blocks), nblocks)
    nbytes = nblocks * geom.block_bytes
    ref_src = np.ones(nbytes, dtype=np.uint8)
    ref_dst = np.zeros(nbytes, dtype=np.uint8)
    use_nixl = not args.no_nixl and nixl.available()
    why_no_ns = netns.unavailable() if args.netns != "off" else "--netns off"
    if why_no_ns and args.netns == "on":
        raise SystemExit(f"--netns on: {why_no_ns}")
    rows: list[Row] = []
    notes: list[str] = []
    reps = args.repeats

    shm = ShmKvCache()
    with contextlib.ExitStack() as stack:
        src = shm.factory(shape, torch_dtype)
        stack.callback(shm.close)
        src.view(torch.int16).random_(-30000, 30000)
        dst = torch.zeros(shape, dtype=torch_dtype)
        shm_once = shm_reader(shm, dst, remote, local, stack)
        t, ref = paired(shm_once, lambda: np.copyto(ref_dst, ref_src), reps)
        rows.append(Row("shm transport", t, "numpy memcpy (contiguous)", ref))
        check(dst, src, local, remote, "shm")

        def tcp_row(label: str, ns_p: str | None, ns_d: str | None, host: str) -> None:
            dst.zero_()
            with _in(ns_p):
                tcp_once, new_lease = tcp_reader(geom.compat_hash(), src, dst, remote,
                                                 local, stack, host=host)
                listener = _listener(host, stack)
            with _in(ns_d):
                sock_once = socket_streamer(ref_src, ref_dst, reps + 1, stack,
                                            listener=listener)
                t, ref = paired(tcp_once, sock_once, reps, prepare=new_lease)
            rows.append(Row(f"tcp transport{label}", t, f"socket stream{label}", ref))
            check(dst, src, local, remote, "tcp")

        def nixl_row(label: str, tls: str | None) -> None:
            dst.zero_()
            with _ucx_env(UCX_TLS=tls):
                once, ref_once = nixl_reader(src, dst, remote, local, ref_dst, stack)
            t, ref = paired(once, ref_once, reps)
            wire = f" UCX_TLS={tls}" if tls else " (UCX chooses)"
            rows.append(Row(f"nixl transport{wire}{label}", t, f"NIXL raw READ{wire}{label}",
                            ref))
            check(dst, src, local, remote, "nixl")
            if not np.array_equal(ref_dst, src.view(torch.uint8).reshape(-1)[:nbytes].numpy()):
                raise AssertionError("NIXL's reference READ copied wrongly")

        tcp_row("", None, None, "127.0.0.1")
        if use_nixl:
            nixl_row("", None)
            nixl_row("", "tcp")
        else:
            notes.append("nixl: skipped (" + ("--no-nixl" if args.no_nixl
                                              else nixl.INSTALL_HINT) + ")")
        if why_no_ns:
            notes.append(f"across namespaces: skipped ({why_no_ns})")
        else:
            (ns_p, addr_p), (ns_d, _) = stack.enter_context(netns.veth_pair())
            tcp_row(" across netns", ns_p, ns_d, addr_p)
            if use_nixl:
                # the peer (nixl_peer.py) makes bfloat16 caches: the same bytes a block
                spec = {"shape": [*shape[:-1], shape[-1] * src.element_size() // 2],
                        "remote": remote, "local": local,
                        "repeats": reps, "seed": args.seed, "nbytes": nbytes}
                for tls in (None, "tcp"):
                    wire = f" UCX_TLS={tls}" if tls else " (UCX chooses)"
                    t, ref = nixl_across(spec, ns_p, ns_d, tls)
                    rows.append(Row(f"nixl transport{wire} across netns", t,
                                    f"NIXL raw READ{wire} across netns", ref))

    print(f"KV of {args.tokens} tokens: {nblocks} blocks x {geom.block_bytes:,} B = "
          f"{nbytes / 1e6:.1f} MB, scattered in caches of {args.cache_blocks} blocks; "
          f"{reps} rounds, each path alternating with its reference")
    print(f"KV cache dtype {kv_dtype}: {geom.block_bytes / bf16_block:.4f}x bfloat16's bytes "
          f"({geom.block_bytes:,} / {bf16_block:,} B a block"
          + (", scales included)" if geom.scale_layout else ")"))
    width = max(len(n) for r in rows for n in (r.name, r.ref_name)) + 2
    print(f"{'path':<{width}}{'GB/s best':>10}{'ms best':>9}{'ms median':>11}{'ratio':>7}")
    for r in rows:
        for name, t, ratio in ((r.name, r.t, f"{r.ref.best / r.t.best:>7.2f}"),
                               (r.ref_name, r.ref, "")):
            print(f"{name:<{width}}{nbytes / t.best / 1e9:>10.2f}{t.best * 1e3:>9.2f}"
                  f"{t.median * 1e3:>11.2f}{ratio}")
    # Ratios of the best rounds: the least disturbed by other load on the machine.
    print("transfer ratios (reference / transport): " + ", ".join(
        f"{r.name}: {r.ref.best / r.t.best:.2f}" for r in rows))
    for n in notes:
        print(n)
    return 0


@contextlib.contextmanager
def _in(ns: str | None) -> Iterator[None]:
    from kvrelay.bench import netns

    if ns is None:
        yield
    else:
        with netns.entered(ns):
            yield


@contextlib.contextmanager
def _ucx_env(**env: str | None) -> Iterator[None]:
    """UCX reads its environment when an agent's backend is created."""
    import os

    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is not None:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def nixl_across(spec: dict[str, Any], ns_p: str, ns_d: str,
                tls: str | None) -> tuple[Timing, Timing]:
    """nixl between two processes, P's in ``ns_p`` and D's in ``ns_d`` (UCX keeps
    per-process state in the namespace it started in: one process per side)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if tls:
        env["UCX_TLS"] = tls
    cmd = [sys.executable, "-m", "kvrelay.bench.nixl_peer"]
    arg = json.dumps(spec)
    p = subprocess.Popen(["ip", "netns", "exec", ns_p, *cmd, "p", arg], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        offer = p.stdout.readline()
        if not offer:
            raise RuntimeError("the nixl prefill side exited before it offered its cache")
        d = subprocess.run(["ip", "netns", "exec", ns_d, *cmd, "d", arg], env=env,
                           input=offer, capture_output=True, text=True, timeout=600)
        if d.returncode != 0:
            raise RuntimeError(f"the nixl decode side failed: {d.stderr[-2000:]}")
        out = json.loads(d.stdout.strip().splitlines()[-1])
        p.stdin.close()
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    return Timing(*out["t"]), Timing(*out["ref"])


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
               stack: Any, host: str = "127.0.0.1"
               ) -> tuple[Callable[[], None], Callable[[], None]]:
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
    server = RelayServer(table, lock,
                         RelayServerConfig(compat=compat, host=host, transports={"tcp": {}}),
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


def _listener(host: str, stack: Any) -> socket.socket:
    listener = socket.create_server((host, 0))
    stack.callback(listener.close)
    return listener


def socket_streamer(src: Any, dst: Any, rounds: int, stack: Any,
                    listener: socket.socket | None = None) -> Callable[[], None]:
    """The reference: one persistent connection (loopback, or to ``listener``) streaming
    one contiguous buffer per round into one contiguous buffer."""
    listener = listener or _listener("127.0.0.1", stack)
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


def nixl_reader(src: Any, dst: Any, remote: list[int], local: list[int], ref_dst: Any,
                stack: Any, host: str = "127.0.0.1"
               ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The nixl transport reading the lease's scattered blocks out of P's cache, and the
    reference: NIXL's raw READ, between the same two agents, of the same number of
    bytes from the same cache as one contiguous region (one descriptor) into a
    contiguous buffer."""
    from kvrelay.relay.transports.base import PeerInfo
    from kvrelay.relay.transports.nixl import NixlTransport

    p = NixlTransport()
    stack.callback(p.close)
    desc = p.register(src)
    d = NixlTransport(dst)
    stack.callback(d.close)
    return nixl_pair(d, PeerInfo("bench-p:0", "bench-p", desc), remote, local, ref_dst)


def nixl_pair(d: Any, peer: Any, remote: list[int], local: list[int],
              ref_dst: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    import numpy as np

    from kvrelay.relay.transports.base import TransferState

    assert d.agent is not None
    d.agent.register([(ref_dst.ctypes.data, ref_dst.nbytes)], 0, "DRAM")
    one_l = np.array([[ref_dst.ctypes.data, ref_dst.nbytes, 0]], dtype=np.uint64)
    one_r = np.array([[peer.descriptor["addr"], ref_dst.nbytes, peer.descriptor["dev"]]],
                     dtype=np.uint64)

    def once() -> None:
        h = d.read(peer, "lease", "bench", remote, local)
        while (st := d.poll(h)).state is TransferState.PENDING:
            pass
        assert st.state is TransferState.DONE, st.error

    def ref_once() -> None:
        x, err, _ = d.agent.read(d._remotes[peer.relay], one_l, one_r, "DRAM", "DRAM")
        while (st := d.agent.state(x))[0] is TransferState.PENDING and not st[1] and not err:
            pass
        d.agent.release(x)
        assert st[0] is TransferState.DONE, f"NIXL's reference READ failed: {err or st[1]}"

    once()  # loads P's agent metadata (and connects) before the reference needs it
    return once, ref_once


if __name__ == "__main__":  # `python -m kvrelay.bench.transfer`, without the kvrelay CLI
    import sys

    parser = argparse.ArgumentParser(prog="kvrelay bench")
    register(parser.add_subparsers(dest="bench_command", required=True))
    sys.exit(run(parser.parse_args(["transfer", *sys.argv[1:]])))
