"""Run in vLLM's venv (tests/vllm/test_vllm_layouts.py): vLLM's own code plans and
allocates the KV cache of each attention backend's layout (``get_kv_cache_config_from_
groups``, ``allocate_kv_cache``, kernel sizes from ``select_common_block_size``), kvrelay
describes the views, and random block sets move P -> D over tcp (in place, and staged
through host buffers on both sides as for a cache on a GPU) and nixl where it is
installed; every byte of D's blocks is compared with P's through vLLM's own
``group_kernel_blocks``. Prints one JSON line.

    PYTHONPATH=. $VLLM_VENV/bin/python -m tests.vllm.layouts_probe
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

from kvrelay.relay.transports import nixl
from kvrelay.relay.transports.layout import HostCache, layer_cache, tensor_cache
from kvrelay.testing.kv import move_over_nixl, move_over_tcp
from kvrelay.vllm.connector import KvRelayConnector

LAYERS, P_BLOCKS, D_BLOCKS, TRIALS = 3, 12, 9, 12
STAGING_CHUNK = 4099  # odd: ranges straddle the staging buffers' chunks
NIXL_SETS = 3  # NIXL agents are slow to make: the first few sets only
# FlashInfer does not import without the flashinfer package: its layouts, copied from
# vllm 0.32.0 v1/attention/backends/flashinfer.py:604-610 and 0.34.0 :731-739 (their
# sources are pinned in test_vllm_layouts.py): (LBHNC, BLHNC) on SM100; else 0.32 none
# declared (vLLM's default preference, LBNHC first), 0.34 that preference less LHBNC.
FLASHINFER_SM100 = (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)


def full(block_size: int) -> Any:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=32,
                             dtype=torch.bfloat16)


def mla(block_size: int) -> Any:
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16)


def cases() -> list[tuple[str, Any, KVCacheLayout, Any, str]]:
    """(case, spec, layout, backend class or None, backend name)."""
    fa_default = get_supported_kv_cache_layouts([FlashAttentionBackend])[0]
    out = [("CPU_ATTN", full(32), get_supported_kv_cache_layouts([CPUAttentionBackend])[0],
            CPUAttentionBackend, "CPU_ATTN"),
           ("FLASH_ATTN default", full(16), fa_default, FlashAttentionBackend, "FLASH_ATTN"),
           ("FLASH_ATTN with kvrelay's LBHNC", full(16), KVCacheLayout.LBHNC,
            FlashAttentionBackend, "FLASH_ATTN"),
           ("FLASHINFER", full(16), fa_default, None, "FLASHINFER")]
    out += [(f"FLASHINFER SM100 {lay.name}", full(16), lay, None, "FLASHINFER")
            for lay in FLASHINFER_SM100]
    mla_layout = get_supported_kv_cache_layouts([FlashMLABackend])[0]
    out += [("FLASHMLA block 128", mla(128), mla_layout, FlashMLABackend, "FLASHMLA"),
            ("FLASHMLA block 64", mla(64), mla_layout, FlashMLABackend, "FLASHMLA")]
    out += [(f"any {lay.name}", full(16), lay, None, "TEST")
            for lay in (KVCacheLayout.LHBNC, KVCacheLayout.BLNHC, KVCacheLayout.BHLNC)]
    return out


def vllm_cache(spec: Any, layout: KVCacheLayout, backend: Any, num_blocks: int
               ) -> tuple[dict[str, torch.Tensor], int]:
    """The views vLLM's worker hands register_kv_caches, and the kernel block size."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout,
                                     num_gpu_blocks_override=num_blocks,
                                     prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    kv_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(names, spec)], 1 << 34)
    kernel = (select_common_block_size(spec.block_size, [backend], [spec])
              if backend is not None else spec.block_size)
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout, [kernel])
    return caches, kernel


def check(p: dict[str, torch.Tensor], d: dict[str, torch.Tensor], remote: list[int],
          local: list[int], d_cache: HostCache) -> None:
    for name in p:
        pb = group_kernel_blocks(p[name], P_BLOCKS)
        db = group_kernel_blocks(d[name], D_BLOCKS)
        for r, lb in zip(remote, local, strict=True):
            assert torch.equal(db[lb].view(torch.uint8), pb[r].view(torch.uint8)), (
                f"{name}: D block {lb} is not P block {r}")
    for name in d:
        for lb in local:
            group_kernel_blocks(d[name], D_BLOCKS)[lb].zero_()
    assert not any(a.any() for a in d_cache.arrays), "bytes outside the blocks were written"


def block_sets(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    out = [([3, 4, 5, 6], [0, 1, 2, 3]), ([0, 11, 5], [8, 2, 3])]
    for _ in range(TRIALS):
        n = rng.randint(1, D_BLOCKS)
        remote = rng.sample(range(P_BLOCKS), n)
        local = sorted(rng.sample(range(D_BLOCKS), n)) if rng.random() < 0.5 else (
            rng.sample(range(D_BLOCKS), n))
        out.append((remote, local))
    return out


def run_case(case: str, spec: Any, layout: KVCacheLayout, backend: Any, name: str,
             rng: random.Random) -> dict[str, Any]:
    p, kernel = vllm_cache(spec, layout, backend, P_BLOCKS)
    pc = layer_cache(p, P_BLOCKS, name)
    for a in pc.arrays:
        a[:] = np.frombuffer(rng.randbytes(a.size), dtype=np.uint8)
    moved = {"tcp": 0, "tcp_staged": 0, "nixl": 0}
    staged_p = tensor_cache(p, P_BLOCKS, name)  # a GPU P's path, on these CPU tensors
    for i, (remote, local) in enumerate(block_sets(rng)):
        legs = ["tcp", "tcp_staged"] + (["nixl"] if nixl.available() and i < NIXL_SETS else [])
        for transport in legs:
            d, _ = vllm_cache(spec, layout, backend, D_BLOCKS)
            dc = layer_cache(d, D_BLOCKS, name)
            assert dc.layout.name == pc.layout.name
            if transport == "tcp":
                move_over_tcp(pc, dc, remote, local)
            elif transport == "tcp_staged":  # P and D staged through small buffers
                move_over_tcp(staged_p, tensor_cache(d, D_BLOCKS, name), remote, local,
                              chunk_bytes=STAGING_CHUNK)
            else:
                move_over_nixl(pc, dc, remote, local, timeout=20)
            check(p, d, remote, local, dc)
            moved[transport] += 1
    first = next(iter(p.values()))
    return {"case": case, "vllm_layout": layout.name, "kernel_block": kernel,
            "block_size": spec.block_size, "shape": list(first.shape),
            "contiguous": first.is_contiguous(), "name": pc.layout.name,
            "order": pc.layout.order, "ranges_per_run": len(pc.placement.ranges([3, 4, 5])),
            "moved": moved}


def main() -> None:
    rng = random.Random(41)
    out: dict[str, Any] = {
        "cpu_layouts": [x.name for x in CPUAttentionBackend.supported_kv_cache_layouts()],
        "flash_attn_declares": FlashAttentionBackend.supported_kv_cache_layouts(),
        "flashmla_kernel_sizes": FlashMLABackend.get_supported_kernel_block_sizes(),
        "connector_asks": {kind: KvRelayConnector.get_required_kvcache_layout(
            SimpleNamespace(model_config=SimpleNamespace(use_mla=kind == "mla")))
            for kind in ("full", "mla")},
        "cases": [], "failed": []}
    for case in cases():
        try:
            out["cases"].append(run_case(*case, rng))
        except Exception as e:  # reported, and the other cases still run
            out["failed"].append(f"{case[0]}: {type(e).__name__}: {e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
