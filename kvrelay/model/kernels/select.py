"""Which kernel backend a model runs with: the native one where it can run the model,
else the pure-torch one, by ``--kernels`` or KVRELAY_KERNELS."""

from __future__ import annotations

import logging

import torch

from kvrelay import env
from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.model.kernels import ext
from kvrelay.model.kernels.backend import KERNEL_CHOICES, KernelBackend, TorchBackend
from kvrelay.model.kernels.native import NativeBackend
from kvrelay.model.kernels.rope import RotaryTable

log = logging.getLogger("kvrelay.model")


def select_backend(
    cfg: ModelConfig,
    rope: RotaryTable,
    dtype: torch.dtype,
    device: torch.device,
    requested: str | None = None,
) -> KernelBackend:
    """The backend for this model, by ``requested`` or ``KVRELAY_KERNELS`` (default
    ``auto``); recorded for the log and /metrics."""
    choice = (requested or env.get("KVRELAY_KERNELS")).lower()
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"kernels {choice!r} (KVRELAY_KERNELS or --kernels) is not one of "
            f"{', '.join(KERNEL_CHOICES)}"
        )
    reason = "requested"
    if choice != "torch":
        why_not = ext.unavailable(cfg, dtype, device)
        if why_not is None:
            nat = NativeBackend(cfg, rope, dtype)
            kernel_choice.record_kernels(nat.name, nat.isa, "")
            kernel_choice.record_prompt_attention(nat.prompt_route())
            return nat
        reason = why_not
        if choice == "native":
            log.warning("native kernels requested but unavailable: %s; using torch", why_not)
    kernel_choice.record_kernels("torch", "", reason)
    kernel_choice.record_prompt_attention("torch")
    # Why GGUF codes cannot be served as stored here, as the native kernels' reason.
    native_off = ext.load_error() or "the torch kernels were chosen"
    return TorchBackend(cfg, rope, dtype, native_off=native_off)
