"""KvRelayConnector's transports on vLLM's GPU KV layout: every byte checked, GB/s
against a device-to-device copy of the same bytes measured in the same run.

    python -m kvrelay.bench.connector_kv --device cuda [--out FILE]
    python -m kvrelay.bench.connector_kv --device cpu      dry run: tiny shapes

Caches are vLLM's per-layer ``[B, H, N, C]`` views of one allocation in LBNHC order
(the GPU default: FlashAttention, FlashInfer off SM100), described by
``layout.layer_cache`` as the connector's ``register_kv_caches`` does (a
``TensorCache`` on a GPU). Legs, each a P -> D move of ``--blocks`` blocks (the best of
``--reps``, after a warm-up that also checks a scattered block set byte for byte):

- ``d2d``: the reference, one device copy of the same run of blocks per cache;
- ``tcp_staged``: tcp's stream code over a socket pair, P and D staged through pinned
  host buffers (``StagedBlocks``, ``staging_mib`` 64), P's copies fenced after the
  kernel that wrote the blocks (a CUDA event, as the connector fences a step's leases);
- ``nixl``: one READ, both caches registered as VRAM (skipped without NIXL);
- ``cuda_ipc``: D copies out of P's cache exported by another process (CUDA only).

Prints one table line per leg and ``--out`` JSON; exits 1 if any leg moved a wrong byte.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.base import PeerInfo, TransferState
from kvrelay.relay.transports.cuda_ipc import CudaIpcTransport, TorchCudaIpc, descriptor
from kvrelay.relay.transports.layout import TensorCache, tensor_cache
from kvrelay.relay.transports.staging import StagedBlocks

# layers, blocks, heads, tokens per block, content (K and V of head 128), dtype
SHAPES = {"cuda": (16, 512, 8, 16, 256, torch.bfloat16),  # 1 MiB a block, 512 MiB a cache
          "cpu": (2, 32, 2, 4, 16, torch.float32)}
SEED = 7
STAGING_MIB = 64


def lbnhc_views(device: str, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of one [L, B, N, H, C] allocation (LBNHC)."""
    layers, blocks, heads, tokens, content, dtype = SHAPES[device]
    raw = torch.zeros(layers, blocks, tokens, heads, content, dtype=dtype, device=device)
    if fill:
        g = torch.Generator(device=device).manual_seed(SEED)
        raw.view(torch.int16).random_(generator=g)
    per_layer = raw.permute(0, 1, 3, 2, 4)
    return {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(layers)}


def cache_of(views: dict[str, torch.Tensor]) -> TensorCache:
    return tensor_cache(views, None, "FLASH_ATTN")


def same(p: dict[str, torch.Tensor], d: dict[str, torch.Tensor], remote: list[int],
         local: list[int]) -> bool:
    idx_r = torch.tensor(remote, device=next(iter(p.values())).device)
    idx_l = torch.tensor(local, device=idx_r.device)
    # As bytes: random bits make NaNs, which never equal themselves.
    return all(torch.equal(d[n].view(torch.uint8).index_select(0, idx_l),
                           p[n].view(torch.uint8).index_select(0, idx_r)) for n in p)


def clear(cache: TensorCache) -> None:
    """D's blocks back to zero between legs, so each leg's check sees its own bytes."""
    for t in cache.tensors:
        t.zero_()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best(fn: Callable[[], None], reps: int, device: str) -> float:
    t = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        t = min(t, time.perf_counter() - t0)
    return t


def tcp_move(pc: TensorCache, dc: TensorCache, remote: list[int], local: list[int],
             p_blocks: StagedBlocks, d_blocks: StagedBlocks) -> None:
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(target=p_blocks.send, args=(a, remote))
        sender.start()
        d_blocks.recv(b, local, threading.Event())
        sender.join()
    finally:
        a.close()
        b.close()


def poll_done(tr: Any, h: Any, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while (st := tr.poll(h)).state is TransferState.PENDING:
        if time.monotonic() > end:
            raise TimeoutError("the read did not finish")
    if st.state is not TransferState.DONE:
        raise RuntimeError(st.error)


def producer() -> None:
    """``--produce``: P's cache in this process, exported through CUDA IPC; the
    descriptor as one JSON line; kept alive until stdin gets a line."""
    pc = cache_of(lbnhc_views("cuda", fill=True))
    d = descriptor(pc, TorchCudaIpc())
    torch.cuda.synchronize()
    print(json.dumps(d, default=lambda b: {"hex": b.hex()}), flush=True)
    sys.stdin.readline()


def _unhex(x: Any) -> Any:
    if isinstance(x, dict):
        return (bytes.fromhex(x["hex"]) if set(x) == {"hex"}
                else {k: _unhex(v) for k, v in x.items()})
    return [_unhex(v) for v in x] if isinstance(x, list) else x


def run(device: str, n: int, reps: int) -> dict[str, Any]:
    p, d = lbnhc_views(device, fill=True), lbnhc_views(device, fill=False)
    pc, dc = cache_of(p), cache_of(d)
    blocks = pc.num_blocks
    n = min(n, blocks // 2)
    scattered = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
    remote_s, local_s = scattered[:n].tolist(), scattered[n:2 * n].tolist()
    remote, local = list(range(blocks // 4, blocks // 4 + n)), list(range(n))
    nbytes = n * pc.layout.block_bytes
    out: dict[str, Any] = {"device": device, "layout": pc.layout.name, "bytes": nbytes,
                           "legs": {}}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    layers, lo, hi = SHAPES[device][0], blocks // 4, blocks // 4 + n

    def d2d() -> None:  # one storage a side, L outermost: one copy of the run per cache
        for s, t in zip(pc.tensors, dc.tensors, strict=True):
            t.view(layers, blocks, -1)[:, :n].copy_(s.view(layers, blocks, -1)[:, lo:hi])

    out["legs"]["d2d"] = leg(d2d, reps, device, nbytes, lambda: same(p, d, remote, local))

    p_io = StagedBlocks(pc, pinned_bytes=STAGING_MIB << 20)
    d_io = StagedBlocks(dc, pinned_bytes=STAGING_MIB << 20)
    p_io.fence(list(range(blocks)))  # after the fill, as P fences a step's leases
    clear(dc)
    tcp_move(pc, dc, remote_s, local_s, p_io, d_io)
    ok = same(p, d, remote_s, local_s)
    out["legs"]["tcp_staged"] = leg(lambda: tcp_move(pc, dc, remote, local, p_io, d_io),
                                    reps, device, nbytes,
                                    lambda: ok and same(p, d, remote, local))
    if nixl.available():
        src, dst = nixl.NixlTransport(), nixl.NixlTransport(dc)
        try:
            peer = PeerInfo("p:1", "p", src.register(pc))

            def nixl_read(r: list[int] = remote, lc: list[int] = local) -> None:
                poll_done(dst, dst.read(peer, "L", "d", r, lc))

            clear(dc)
            nixl_read(remote_s, local_s)
            ok = same(p, d, remote_s, local_s)
            out["legs"]["nixl"] = leg(nixl_read, reps, device, nbytes,
                                      lambda: ok and same(p, d, remote, local),
                                      mem=src.local.mem if src.local else "")
        finally:
            dst.close()
            src.close()
    else:
        out["legs"]["nixl"] = {"skipped": nixl.INSTALL_HINT}
    out["legs"]["cuda_ipc"] = (ipc_leg(p, d, dc, remote, local, remote_s, local_s, reps,
                                       nbytes) if device == "cuda"
                               else {"skipped": "needs CUDA"})
    ref = out["legs"]["d2d"]["seconds"]
    for v in out["legs"].values():
        if "seconds" in v:
            v["vs_d2d"] = round(ref / v["seconds"], 3)
    return out


def ipc_leg(p: dict[str, torch.Tensor], d: dict[str, torch.Tensor], dc: TensorCache,
            remote: list[int], local: list[int], remote_s: list[int], local_s: list[int],
            reps: int, nbytes: int) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.bench.connector_kv", "--produce"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        desc = _unhex(json.loads(proc.stdout.readline()))
        tr = CudaIpcTransport(dc)
        peer = PeerInfo("127.0.0.1:1", "p", desc)

        def ipc_read(r: list[int] = remote, lc: list[int] = local) -> None:
            poll_done(tr, tr.read(peer, "L", "d", r, lc))

        clear(dc)
        ipc_read(remote_s, local_s)
        ok = same(p, d, remote_s, local_s)  # P's process filled from the same seed
        result = leg(ipc_read, reps, "cuda", nbytes, lambda: ok and same(p, d, remote, local))
        proc.stdin.write("\n")
        proc.stdin.flush()
        return result
    finally:
        proc.wait(timeout=60)


def leg(fn: Callable[[], None], reps: int, device: str, nbytes: int,
        check: Callable[[], bool], **extra: Any) -> dict[str, Any]:
    """The best of ``reps`` runs of ``fn``; ``check`` after them: D holds P's bytes."""
    s = best(fn, reps, device)
    return {"seconds": s, "gb_s": round(nbytes / s / 1e9, 3), "bytes_ok": check(), **extra}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(SHAPES), default="cuda")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--produce", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.produce:
        producer()
        return 0
    out = run(a.device, a.blocks, a.reps)
    print(f"{out['layout']} on {out.get('gpu', a.device)}, {out['bytes'] / 2**20:.1f} MiB "
          "a move")
    print(f"{'leg':<12} {'ms':>9} {'GB/s':>8} {'vs d2d':>7} bytes")
    for name, v in out["legs"].items():
        if "skipped" in v:
            print(f"{name:<12} skipped: {v['skipped']}")
        else:
            print(f"{name:<12} {v['seconds'] * 1e3:9.3f} {v['gb_s']:8.2f} "
                  f"{v['vs_d2d']:7.3f} {'ok' if v['bytes_ok'] else 'WRONG'}")
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    bad = [k for k, v in out["legs"].items() if v.get("bytes_ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
