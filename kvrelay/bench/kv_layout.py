"""Block-major vs layer-major KV cache: compute and transfer cost on the default model's
geometry. Run: ``python -m kvrelay.bench.kv_layout [--dtype bfloat16] [--threads 2]``.

compute: per decode step, every layer writes the step's K/V and gathers each
request's context (the runner's row index_copy_/index_select), for B requests of
``ctx`` tokens. transfer: copying one request's blocks out of the cache into a
contiguous buffer (what a transport sends), and back.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

LAYERS, KVH, D, BS = 30, 3, 64, 16  # SmolLM2-135M


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure(dtype: torch.dtype, batch: int, ctx: int, num_blocks: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    per_req = -(-ctx // BS)
    tables = torch.randperm(num_blocks, generator=g)[: batch * per_req].view(batch, per_req)
    pos = torch.arange(ctx)
    blk = tables[:, pos // BS]
    off = (pos % BS).expand(batch, -1)
    new = torch.randn(2 * batch, KVH * D).to(dtype)
    # Block-major (the interface): (NB, L, 2, BS, KVH, D); a layer's K row of a slot is
    # ((blk * L + l) * 2) * BS + off.
    bm = torch.zeros(num_blocks, LAYERS, 2, BS, KVH, D, dtype=dtype)
    bm_rows = bm.view(-1, KVH * D)
    bm_k = (blk * LAYERS * 2 * BS + off).reshape(-1)
    bm_read = torch.cat([bm_k, bm_k + BS])
    bm_write = torch.cat([bm_k[::ctx], bm_k[::ctx] + BS])
    # Layer-major: (L, 2, NB, BS, KVH, D); K row = (l * 2 * NB) * BS + blk * BS + off.
    lm = torch.zeros(LAYERS, 2, num_blocks, BS, KVH, D, dtype=dtype)
    lm_rows = lm.view(-1, KVH * D)
    lm_k = (blk * BS + off).reshape(-1)
    lm_read = torch.cat([lm_k, lm_k + num_blocks * BS])
    lm_write = torch.cat([lm_k[::ctx], lm_k[::ctx] + num_blocks * BS])

    def step(rows: torch.Tensor, read: torch.Tensor, write: torch.Tensor, stride: int) -> None:
        for layer in range(LAYERS):
            rows.index_copy_(0, write + layer * stride, new)
            rows.index_select(0, read + layer * stride)

    one = tables[0]
    return {
        "compute block-major ms": 1e3 * _time(lambda: step(bm_rows, bm_read, bm_write, 2 * BS), 5),
        "compute layer-major ms": 1e3
        * _time(lambda: step(lm_rows, lm_read, lm_write, 2 * num_blocks * BS), 5),
        "transfer block-major ms": 1e3 * _time(lambda: bm.index_select(0, one), 50),
        "transfer layer-major ms": 1e3 * _time(lambda: lm.index_select(2, one), 50),
        "copies per request block-major": float(len(one)),
        "copies per request layer-major": float(len(one) * LAYERS * 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=192)
    p.add_argument("--num-blocks", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    res = measure(getattr(torch, args.dtype), args.batch, args.ctx, args.num_blocks)
    print(f"{args.batch} requests x {args.ctx} tokens, {args.dtype}, {args.threads} threads")
    for k, v in res.items():
        print(f"{k:<34}{v:>10.3f}")
    ratio = res["compute block-major ms"] / res["compute layer-major ms"]
    print(f"compute ratio block-major/layer-major: {ratio:.2f}")


if __name__ == "__main__":
    main()
