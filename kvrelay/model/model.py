"""A Llama-family decoder (Llama, Mistral, Qwen2) over a flat token dimension.

All scheduled tokens of a step, from every request, go through each layer as one
(T, hidden) matrix; only attention looks at request boundaries (attention.py).
Weights are kept as plain contiguous matrices, with q/k/v and gate/up fused so a
layer is four matmuls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.model.attention import AttnMetadata, paged_attention
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryTable


class Linear:
    """y = x W^T + b. On CPU the weight is reordered once, at load, into oneDNN's
    blocked layout: F.linear reorders (bfloat16) or runs an unpacked GEMM (float32)
    on every call; packed is 1.3-2.5x faster at decode batch sizes (docs/model.md)."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        supported = dtype is torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        probe = Linear(torch.ones(32, 32, dtype=dtype), None, pack=True)
        return bool(supported) and bool(
            torch.equal(
                probe(torch.ones(2, 32, dtype=dtype)), torch.full((2, 32), 32.0, dtype=dtype)
            )
        )
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return False


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear  # (q + 2 kv, hidden), fused
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear  # (2 * intermediate, hidden), fused
    down: Linear


class MissingWeight(KeyError):
    pass


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        state: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        """``state`` uses Hugging Face parameter names and layout."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = device

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise MissingWeight(f"weight {name!r} is missing from the model file")
            return state[name].to(device=device, dtype=dtype).contiguous()

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([get(n) for n in names], dim=0).contiguous()

        pack = can_pack(dtype, device)
        self.packed = pack
        self.embed = get("model.embed_tokens.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in state
        self.lm_head = Linear(self.embed if tied else get("lm_head.weight"), None, pack)
        self.norm = get("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = (a + "q_proj", a + "k_proj", a + "v_proj")
            self.layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    qkv=Linear(
                        cat(*(n + ".weight" for n in qkv)),
                        cat(*(n + ".bias" for n in qkv)) if cfg.qkv_bias else None,
                        pack,
                    ),
                    o=Linear(
                        get(a + "o_proj.weight"),
                        get(a + "o_proj.bias") if cfg.o_bias else None,
                        pack,
                    ),
                    ffn_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(
                        cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), None, pack
                    ),
                    down=Linear(get(p + "mlp.down_proj.weight"), None, pack),
                )
            )
        self.rope = RotaryTable(cfg, max_len, dtype, device, rope_freq_factors)
        self._split = [
            (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttnMetadata,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run every token, write its K/V, return float32 logits of ``logit_rows``."""
        cfg = self.cfg
        T = input_ids.shape[0]
        kv_rows = kv_cache.view(-1, cfg.num_kv_heads * cfg.head_dim)
        cos, sin = self.rope.lookup(positions)
        heads_qk = cfg.num_heads + cfg.num_kv_heads
        h = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.attn_norm)
            qk, v = layer.qkv(x).split(self._split, dim=-1)
            # q and k are adjacent in the fused projection: rotate them together.
            qk = self.rope.apply(qk.view(T, heads_qk, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            o = paged_attention(q, k, v, kv_rows, i, meta)
            h = h + layer.o(o)
            x = self._rms_norm(h, layer.ffn_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        h = self._rms_norm(h[logit_rows], self.norm)
        return self.lm_head(h).float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As in transformers: normalize in float32, cast back, then scale. rms_norm of
        # a bfloat16 tensor computes in float32 inside and rounds once, which is the
        # same as casting around it, without two copies.
        shape, eps = (x.shape[-1],), self.cfg.rms_norm_eps
        if x.dtype is torch.float32:
            return F.rms_norm(x, shape, weight, eps)
        return weight * F.rms_norm(x, shape, None, eps)
