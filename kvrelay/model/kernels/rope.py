"""Rotary position embeddings (rotate-half layout, as Hugging Face models use)."""

from __future__ import annotations

import math

import torch

from kvrelay.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if cfg.rope_type == "linear":
        inv = inv / float(scaling["factor"])
    elif cfg.rope_type == "llama3":
        inv = _llama3_scale(inv, scaling)
    if freq_factors is not None:
        # GGUF stores Llama 3 scaling as per-frequency divisors (rope_freqs.weight).
        inv = inv / freq_factors.to(torch.float64)
    return inv


def _llama3_scale(inv: torch.Tensor, s: dict[str, object]) -> torch.Tensor:
    """Llama 3.1 frequency scaling, as in transformers' ``_compute_llama3_parameters``."""
    factor = float(s["factor"])  # type: ignore[arg-type]
    low = float(s.get("low_freq_factor", 1.0))  # type: ignore[arg-type]
    high = float(s.get("high_freq_factor", 4.0))  # type: ignore[arg-type]
    old_len = float(s.get("original_max_position_embeddings", 8192))  # type: ignore[arg-type]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to ``max_len``, computed once at load."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        inv = inv_frequencies(cfg, freq_factors).to(torch.float32)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        # rotate_half(x) * sin == swap_halves(x) * signed_sin: one flip instead of a
        # negation and a concatenation per application.
        signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        self.signed_sin = signed.to(dtype=dtype, device=device)
        self._f32 = (emb.cos().contiguous(), signed.contiguous())

    def float32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin as float32 (max_len, D) on the CPU, for native kernels."""
        return self._f32

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for (T,) positions, shaped (T, 1, D): once per step."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D), rotate-half layout (as transformers' apply_rotary_pos_emb)."""
        T, n, D = x.shape
        swapped = x.reshape(T, n, 2, D // 2).flip(2).reshape(T, n, D)
        return x * cos + swapped * signed_sin
