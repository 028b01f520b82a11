"""The native extension (kvrelay/model/kernels/csrc, C++ and OpenMP), built ahead of time
by ``make`` into ``kvrelay/model/kernels/_native*.so`` against the installed torch:
loading it once, refusing a build from other sources, and why it cannot run a model."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from kvrelay.model.config import ModelConfig

_module: ModuleType | None = None
_load_error: str | None = None

# The bindings' version (csrc/bindings.cpp, m.attr("API")): 2 since attention() takes
# skip_from and skip_tokens (ints) where it took skip_fresh (a bool); 3 since every
# attention tile scores in one order (a module from older sources would run without
# error but answer otherwise once a prompt's prefix is cached: docs/model.md); 4 since
# attention() takes a uint8 cache (--kv-cache-dtype fp8_e4m3: codes and scales).
API = 4


def load() -> ModuleType | None:
    """The extension module, imported once; None (with ``load_error()``) if it fails."""
    global _module, _load_error
    if _module is None and _load_error is None:
        try:
            _native = importlib.import_module("kvrelay.model.kernels._native")
            built = getattr(_native, "API", 1)
            if built != API:
                _load_error = (f"extension built from other sources (bindings API {built}, "
                               f"this kvrelay needs {API}); rebuild it with `make`")
            elif _native.isa() == "none":
                _load_error = "the CPU has neither AVX2 nor AVX-512"
            else:
                _module = _native
        except ImportError as e:  # not built, or built against another torch
            _load_error = f"extension not loadable ({e}); build it with `make`"
    return _module


def load_error() -> str | None:
    load()
    return _load_error


def unavailable(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the native kernels cannot run this model, or None when they can."""
    if cfg.head_dim % 16 or cfg.head_dim > 512:
        return f"native attention needs head_dim a multiple of 16 up to 512, not {cfg.head_dim}"
    if device.type != "cpu":
        return f"native kernels are CPU-only, the model is on {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"native kernels take float32 or bfloat16, not {dtype}"
    mod = load()
    if mod is None:
        return _load_error
    return _self_check(mod, dtype)


def _self_check(mod: Any, dtype: torch.dtype) -> str | None:
    """A tiny RMSNorm and silu * mul against torch: catches a broken build at load."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(dtype)
    w = torch.rand(64, generator=g).to(dtype)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
    silu = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    if not torch.allclose(mod.rms_norm(x, w, 1e-6), ref, rtol=tol, atol=tol):
        return "native RMSNorm disagrees with torch at load"
    if not torch.allclose(mod.silu_mul(x), silu, rtol=tol, atol=tol):
        return "native silu * mul disagrees with torch at load"
    return None
