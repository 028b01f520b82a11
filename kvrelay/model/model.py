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


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # (q + 2 kv, hidden)
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # (2 * intermediate, hidden)
    w_down: torch.Tensor


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

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings or "lm_head.weight" not in state
            else get("lm_head.weight")
        )
        self.norm = get("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = (a + "q_proj", a + "k_proj", a + "v_proj")
            self.layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    wqkv=cat(*(n + ".weight" for n in qkv)),
                    bqkv=cat(*(n + ".bias" for n in qkv)) if cfg.qkv_bias else None,
                    wo=get(a + "o_proj.weight"),
                    bo=get(a + "o_proj.bias") if cfg.o_bias else None,
                    ffn_norm=get(p + "post_attention_layernorm.weight"),
                    w_gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    w_down=get(p + "mlp.down_proj.weight"),
                )
            )
        self.rope = RotaryTable(cfg, max_len, dtype, device, rope_freq_factors)
        self._split = [
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
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
        h = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.attn_norm)
            q, k, v = F.linear(x, layer.wqkv, layer.bqkv).split(self._split, dim=-1)
            q, k = self.rope.apply(
                q.view(T, cfg.num_heads, cfg.head_dim),
                k.view(T, cfg.num_kv_heads, cfg.head_dim),
                positions,
            )
            v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            o = paged_attention(q, k, v, kv_cache[:, i], meta)
            h = h + F.linear(o, layer.wo, layer.bo)
            x = self._rms_norm(h, layer.ffn_norm)
            gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.w_down)
        h = self._rms_norm(h[logit_rows], self.norm)
        return F.linear(h, self.lm_head).float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As in transformers: normalize in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)
