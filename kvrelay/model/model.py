"""A Llama-family decoder (Llama, Mistral, Qwen2) over a flat token dimension.

All scheduled tokens of a step, from every request, go through each layer as one
(T, hidden) matrix; only attention looks at request boundaries (attention.py).
Weights are kept as plain contiguous matrices, with q/k/v and gate/up fused so a
layer is four matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.model.kernels import hugepages
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.kernels.backend import EVERY_ROWS, KernelBackend, SmallGemm, StepMetadata
from kvrelay.model.kernels.rope import RotaryTable
from kvrelay.model.kernels.select import select_backend

if TYPE_CHECKING:
    from kvrelay.model.formats.gguf_loader import QuantWeight

class Linear:
    """y = x W^T + b. On CPU the weight is reordered once, at load, into oneDNN's
    blocked layout: F.linear reorders (bfloat16) or runs an unpacked GEMM (float32)
    on every call; packed is 1.3-2.5x faster at decode batch sizes (docs/model.md).
    With ``small`` (the backend's small_gemm: bfloat16 on an AVX-512 BF16 CPU, float32
    with AVX-512 or AVX2) calls of at most ``small.max_rows`` rows go to the native
    kernel instead (the GGUF codes take every call). oneDNN's copy is made only where
    some calls are left to it."""

    __slots__ = ("bias", "packed", "small", "small_k", "small_rows", "small_w", "weight")
    small: Callable[..., torch.Tensor] | None

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
        small: SmallGemm | None = None,
        arena: hugepages.Arena | None = None,
        small_w: torch.Tensor | None = None,
    ) -> None:
        """``arena``: where the native GEMMs' packed weights go (2 MiB pages);
        ``small_w``: small's weight already packed (the GGUF codes as stored)."""
        self.weight = weight
        self.bias = bias
        if small_w is None and small is not None:
            small_w = small.pack(weight)
        self.small_w = small_w
        if arena is not None and self.small_w is not None:
            self.small_w = arena.copy(self.small_w)
        self.small = small.run if small is not None and self.small_w is not None else None
        self.small_k = small if self.small is not None else None
        self.small_rows = small.rows_for(weight) if small is not None and self.small else 0
        self.packed: torch.Tensor | None = None
        if pack and self.small_rows < EVERY_ROWS:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (0 rows: a chunked prefill step that samples nothing gives lm_head no rows)
        rows = x.shape[0]
        if self.small is not None and 0 < rows <= self.small_rows:
            y: torch.Tensor = self.small(x, self.small_w, self.weight.shape[0], self.bias)
            return y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu_mul(
        self, x: torch.Tensor, unfused: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """silu(gate) * up of this fused (gate, up) Linear: in the same call where a
        native kernel takes it (the AMX tiles' epilogue, or each thread's columns of the
        decode GEMMs; the same values, one pass over memory less), else
        ``unfused(self(x))`` (oneDNN's calls)."""
        rows = x.shape[0]
        kernel, w = self.small_k, self.small_w
        if kernel is not None and w is not None and 0 < rows <= self.small_rows:
            y = kernel.run_silu(x, w, self.weight.shape[0], self.bias)
            if y is not None:
                return y
        return unfused(self(x))


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
        kernels: str | None = None,
        quantized: Mapping[str, QuantWeight] | None = None,
        quantized_optional: bool = False,
    ) -> None:
        """``state`` uses Hugging Face parameter names and layout; ``kernels``: see
        backend.select_backend; ``quantized``: GGUF weights to serve as stored
        (``--quantization gguf``; every call, whatever the dtype and ISA), the native
        backend's job; with
        ``quantized_optional`` (``auto``) the float weights where that backend is not
        the one chosen."""
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
        self.rope = RotaryTable(cfg, max_len, dtype, device, rope_freq_factors)
        self.backend: KernelBackend = select_backend(cfg, self.rope, dtype, device, kernels)
        small = self.backend.small_gemm()
        gguf = None
        if quantized and (not quantized_optional or self.backend.serves_quantized):
            gguf = self.backend.quantized_gemms(quantized)
        self.small_gemm = small is not None or gguf is not None  # a native small-M GEMM
        decode = gguf.label if gguf else small.label if small else "onednn" if pack else "torch"
        every = gguf is not None or (small is not None and small.max_rows >= EVERY_ROWS)
        kernel_choice.record_gemm(
            decode,
            "" if small or gguf
            else self.backend.gemm_off or "not the native backend",
            prefill=decode if every else "onednn" if pack else "torch",
        )
        # The decode GEMMs' packed weights on 2 MiB pages (hugepages), copied as packed.
        arena = hugepages.Arena() if self.small_gemm and hugepages.enabled() else None

        def linear(names: Sequence[str], weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            """One (fused) Linear: the GGUF codes as stored when every part has them in
            served types (one call per type where they differ: gemms.NativeGgufParts;
            every call), else the float weight (packed for
            ``small`` if there is one)."""
            if gguf is not None:
                served = gguf.pack(names)
                if served is not None:
                    return Linear(weight, bias, pack, served[0], arena, served[1])
            return Linear(weight, bias, pack, small, arena)

        self.embed = get("model.embed_tokens.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in state
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head = linear([head], self.embed if tied else get(head), None)
        self.norm = get("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = (a + "q_proj", a + "k_proj", a + "v_proj")
            self.layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    qkv=linear(
                        [n + ".weight" for n in qkv],
                        cat(*(n + ".weight" for n in qkv)),
                        cat(*(n + ".bias" for n in qkv)) if cfg.qkv_bias else None,
                    ),
                    o=linear(
                        [a + "o_proj.weight"],
                        get(a + "o_proj.weight"),
                        get(a + "o_proj.bias") if cfg.o_bias else None,
                    ),
                    ffn_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=linear(
                        [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                        cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), None,
                    ),
                    down=linear(
                        [p + "mlp.down_proj.weight"], get(p + "mlp.down_proj.weight"), None
                    ),
                )
            )

    def build_metadata(
        self, chunks: Sequence[ChunkSpec], positions: torch.Tensor, block_size: int
    ) -> StepMetadata:
        return self.backend.build_metadata(chunks, positions, block_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepMetadata,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run every token, write its K/V, return float32 logits of ``logit_rows``."""
        k = self.backend
        # The residual stream: a fresh tensor (the gather copies), updated in place by
        # add_rms_norm, which fuses each residual add with the norm that follows it.
        h = self.embed[input_ids]
        x = k.rms_norm(h, self.layers[0].attn_norm)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            o = k.attention(layer.qkv(x), kv_cache, i, meta)
            x = k.add_rms_norm(h, layer.o(o), layer.ffn_norm)
            mlp = layer.down(layer.gate_up.silu_mul(x, k.silu_mul))
            if i < last:
                x = k.add_rms_norm(h, mlp, self.layers[i + 1].attn_norm)
            else:
                h += mlp
        h = k.rms_norm(h[logit_rows], self.norm)
        return self.lm_head(h).float()
