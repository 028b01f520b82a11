"""Where the worker's KV cache lives, what each transport makes of it, and the dtype
its bytes are read under (``kv_cache_dtype``).

vLLM hands ``register_kv_caches`` per-layer views in host memory (vLLM-CPU) or on a
CUDA device. ``worker_cache`` describes them (layout.layer_cache: a ``HostCache`` or a
``TensorCache``) and refuses, at start and naming the setting, a combination the
chosen ``kv_transport`` cannot move:

| cache | kv_buffer_device | tcp | nixl | cuda_ipc |
|---|---|---|---|---|
| host | cpu (vLLM-CPU's default) | in place | DRAM | refused |
| CUDA | cuda (the GPU default) | staged through pinned host buffers | VRAM | device to device |
| CUDA | cpu | staged (the buffer is in host memory) | refused | refused |
| host | cuda | refused | refused | refused |

``kv_buffer_device`` is vLLM's "device used by the connector to buffer the KV cache"
(NixlConnector: ``cpu`` on a GPU keeps a host copy of the whole cache, registered as
DRAM, and copies blocks to and from it each step). kvrelay keeps no copy of the cache:
its tcp stages a transfer's blocks through ``staging_mib`` of pinned host memory,
which is what ``cpu`` asks for; nixl and cuda_ipc move the GPU's own memory, so with
``cpu`` they are refused rather than silently ignoring the setting.

``kv_blocks`` is how tcp meets the cache: in place, or ``StagedBlocks``. Copies on a
side stream are fenced after the engine's own work (``fence``, called on vLLM's
thread: P before it makes a step's leases, D before it queues a step's loads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay.relay.transports.cuda_ipc import CudaIpcTransport
from kvrelay.relay.transports.layout import HostCache, TensorCache, layer_cache
from kvrelay.relay.transports.staging import StagedBlocks
from kvrelay.relay.transports.tcp import HostBlocks, block_io
from kvrelay.vllm.settings import ConnectorSettings

# kv_buffer_device values each cache place admits, per transport.
ADMITTED = {
    ("cpu", "tcp"): ("cpu",), ("cpu", "nixl"): ("cpu",), ("cpu", "cuda_ipc"): (),
    ("cuda", "tcp"): ("cuda", "cpu"), ("cuda", "nixl"): ("cuda",),
    ("cuda", "cuda_ipc"): ("cuda",),
}


def buffer_device(vllm_config: Any) -> str | None:
    """vLLM's ``kv_transfer_config.kv_buffer_device``; None where not set or empty (its
    default is the platform's device type: '' on vLLM 0.34's CUDA wheel without a GPU)."""
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    value = getattr(cfg, "kv_buffer_device", None)
    return str(value) if value else None


def check_devices(cache_device: str, kv_transport: str, kv_buffer_device: str | None) -> None:
    """A cache place, transport and buffer device that cannot go together: an error
    naming the settings and what to change (module table)."""
    admitted = ADMITTED[(cache_device, kv_transport)]
    where = "in host memory" if cache_device == "cpu" else "on a CUDA device"
    if not admitted:
        raise ValueError(f"kv_connector_extra_config.kv_transport {kv_transport!r} needs a KV "
                         f"cache on a CUDA device; this engine's is {where}: use tcp or nixl")
    if kv_buffer_device is not None and kv_buffer_device not in admitted:
        raise ValueError(
            f"kv_transfer_config.kv_buffer_device {kv_buffer_device!r} with kv_transport "
            f"{kv_transport!r} and a KV cache {where}: allowed {', '.join(admitted)}"
            + (" (KvRelayConnector keeps no host copy of a GPU cache: nixl registers it "
               "as VRAM, cuda_ipc copies device to device; kv_transport tcp stages "
               "through pinned host buffers)" if cache_device == "cuda" else ""))


def worker_cache(kv_caches: Mapping[str, Any], num_blocks: int | None, backend: str,
                 settings: ConnectorSettings, kv_buffer_device: str | None
                 ) -> HostCache | TensorCache:
    """vLLM's views described, checked against the transport (ValueError naming why)."""
    cache = layer_cache(kv_caches, num_blocks, backend)
    place = "cuda" if isinstance(cache, TensorCache) else "cpu"
    check_devices(place, settings.kv_transport, kv_buffer_device)
    return cache


def kv_blocks(cache: HostCache | TensorCache, settings: ConnectorSettings
              ) -> HostBlocks | StagedBlocks:
    """How the tcp transport reads and writes the cache's blocks."""
    return block_io(cache, pinned_bytes=settings.staging_mib << 20)


def fence(targets: Sequence[Any], block_ids: list[int]) -> None:
    """On vLLM's thread: later copies of these blocks by ``targets`` (the tcp blocks,
    the transport) wait for the device work queued so far: staged tcp and cuda_ipc
    copy on side streams (``StagedBlocks.fence``, ``CudaIpcTransport.fence``); nothing
    for a cache in host memory. nixl's one-sided READ has no stream to order: see
    docs/vllm.md (GPU caches)."""
    if not block_ids:
        return
    for t in targets:
        if isinstance(t, StagedBlocks | CudaIpcTransport):
            t.fence(block_ids)


def kv_cache_dtype(vllm_config: Any, layer_names: list[str], tensor_dtype: str
                   ) -> tuple[str, str]:
    """(the KV cache dtype P and D must share, a digest of the per-layer k/v scales; ''
    where the cache is not quantized). vLLM keeps an fp8 cache (``--kv-cache-dtype
    fp8``, ``fp8_e4m3``, ``fp8_e5m2``) in uint8 tensors and reads each layer's bytes
    under that layer's k and v scales (``_k_scale_float``, ``_v_scale_float``: 1.0, or
    the checkpoint's): the relay moves the bytes as they are, and the compat covers the
    format and the scales, so a P and a D that would read them otherwise are refused at
    HELLO (naming both dtypes). Scales computed from an engine's own first batch
    (``calculate_kv_scales``, older vLLM) differ between P and D: refused at start."""
    cfg = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cfg, "cache_dtype", "auto") or "auto")
    if not (dtype.startswith("fp8") or dtype.startswith("int8")
            or dtype.endswith("per_token_head")):
        return tensor_dtype, ""
    if getattr(cfg, "calculate_kv_scales", False):
        raise ValueError(
            f"KvRelayConnector with --kv-cache-dtype {dtype} and calculate_kv_scales: each "
            "engine computes its own k/v scales from its first batch, so D would read P's "
            "bytes under other scales; serve the checkpoint's scales (turn "
            "calculate_kv_scales off)")
    ctx = getattr(getattr(vllm_config, "compilation_config", None),
                  "static_forward_context", None) or {}
    scales = []
    for name in layer_names:
        layer = ctx.get(name)
        scales.append((name, float(getattr(layer, "_k_scale_float", 1.0)),
                       float(getattr(layer, "_v_scale_float", 1.0))))
    return dtype, hashlib.sha256(repr(scales).encode()).hexdigest()[:12]
