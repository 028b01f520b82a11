"""Where the worker's KV cache lives against kv_transport, vLLM's kv_buffer_device and
staging_mib (kvrelay/vllm/devices.py): each combination the transport cannot move is
refused at start naming the setting; the others get the cache they need. A CUDA cache
is stood for by CPU views that say they are on cuda:1 (the device is faked, nothing
is moved here: tests/unit/relay/test_relay_device_cache.py moves the bytes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvrelay.relay.transports.layout import HostCache, TensorCache
from kvrelay.relay.transports.staging import StagedBlocks
from kvrelay.relay.transports.tcp import HostBlocks
from kvrelay.vllm.devices import buffer_device, kv_blocks, worker_cache
from kvrelay.vllm.settings import ConnectorSettings
from tests.unit.relay.test_relay_device_cache import on_fake_cuda
from tests.unit.relay.test_relay_layout import views


def lbnhc() -> dict[str, torch.Tensor]:
    return views("LBNHC", 2, 8, 1, 2, 4, 8, torch.bfloat16)


@pytest.mark.parametrize(("on_gpu", "transport", "buffer", "refused"), [
    (False, "tcp", "cpu", None), (False, "tcp", None, None), (False, "nixl", "cpu", None),
    (False, "cuda_ipc", "cpu", "needs a KV cache on a CUDA device; this engine's is in "
     "host memory"),
    (False, "tcp", "cuda", "kv_buffer_device 'cuda' with kv_transport 'tcp' and a KV "
     "cache in host memory: allowed cpu"),
    (True, "tcp", "cuda", None), (True, "tcp", "cpu", None), (True, "tcp", None, None),
    (True, "nixl", "cuda", None), (True, "cuda_ipc", "cuda", None),
    (True, "nixl", "cpu", "kv_buffer_device 'cpu' with kv_transport 'nixl' .* allowed "
     "cuda .*keeps no host copy"),
    (True, "cuda_ipc", "cpu", "kv_buffer_device 'cpu' with kv_transport 'cuda_ipc'"),
    (True, "tcp", "xpu", "kv_buffer_device 'xpu' .* allowed cuda, cpu"),
])
def test_cache_place_transport_and_buffer_device(on_gpu: bool, transport: str,
                                                 buffer: str | None,
                                                 refused: str | None) -> None:
    v = on_fake_cuda(lbnhc()) if on_gpu else lbnhc()
    settings = ConnectorSettings(kv_transport=transport)
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            worker_cache(v, 8, "FLASH_ATTN", settings, buffer)
        return
    cache = worker_cache(v, 8, "FLASH_ATTN", settings, buffer)
    assert isinstance(cache, TensorCache if on_gpu else HostCache)
    io = kv_blocks(cache, settings)
    assert isinstance(io, StagedBlocks if on_gpu else HostBlocks)


def test_staging_mib_is_the_page_locked_budget_and_is_checked() -> None:
    settings = ConnectorSettings.from_extra({"staging_mib": 1})
    staged = kv_blocks(worker_cache(on_fake_cuda(lbnhc()), 8, "", settings, None), settings)
    assert isinstance(staged, StagedBlocks)
    assert staged.staging_bytes == 1 << 20 and staged.max_kept == 1
    for bad in (0, 70000):
        with pytest.raises(ValueError, match=r"staging_mib must be 1\.\.65536 \(MiB of "
                                             rf"page-locked .*\), got {bad}"):
            ConnectorSettings.from_extra({"staging_mib": bad})
    with pytest.raises(ValueError, match="staging_mib must be int"):
        ConnectorSettings.from_extra({"staging_mib": "64"})
    assert ConnectorSettings.from_extra({"kv_transport": "cuda_ipc"}).kv_transport == "cuda_ipc"


def test_kv_buffer_device_is_read_from_vllms_config() -> None:
    def cfg(value: object) -> SimpleNamespace:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_buffer_device=value))

    assert buffer_device(cfg("cuda")) == "cuda"
    assert buffer_device(cfg("")) is None  # vLLM 0.34's CUDA wheel without a GPU
    assert buffer_device(SimpleNamespace()) is None


def test_an_8_bit_cache_names_its_dtype_and_scales_and_others_hash_as_before() -> None:
    """vLLM's fp8 cache: the dtype and a digest of every layer's k/v scales (what its
    bytes are read under) go into the compat; any other cache gives its tensor dtype
    and no digest (the compat as before); scales an engine computes itself are refused."""
    from kvrelay.vllm.devices import kv_cache_dtype

    NS = SimpleNamespace

    def cfg(dtype: str, k: float = 1.0, **cache: Any) -> Any:
        layers = {"l0": NS(_k_scale_float=k, _v_scale_float=1.0), "l1": NS()}
        return NS(cache_config=NS(cache_dtype=dtype, **cache),
                  compilation_config=NS(static_forward_context=layers))

    assert kv_cache_dtype(cfg("auto"), ["l0", "l1"], "float32") == ("float32", "")
    assert kv_cache_dtype(NS(), ["l0"], "bfloat16") == ("bfloat16", "")
    dtype, digest = kv_cache_dtype(cfg("fp8"), ["l0", "l1"], "uint8")
    assert dtype == "fp8" and len(digest) == 12
    assert kv_cache_dtype(cfg("fp8"), ["l0", "l1"], "uint8")[1] == digest
    assert kv_cache_dtype(cfg("fp8", k=0.5), ["l0", "l1"], "uint8")[1] != digest
    assert kv_cache_dtype(cfg("fp8_e5m2"), ["l0", "l1"], "uint8")[0] == "fp8_e5m2"
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        kv_cache_dtype(cfg("fp8", calculate_kv_scales=True), ["l0"], "uint8")
