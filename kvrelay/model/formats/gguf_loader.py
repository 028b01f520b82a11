"""Load a GGUF file: metadata -> ModelConfig, tensors dequantized to HF names/layout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import _type_traits, dequantize

from kvrelay.model.config import ModelConfig, UnsupportedModel
from kvrelay.model.formats.gguf_file import GgufFile, GgufTensor
from kvrelay.model.text.gguf_tokenizer import tokenizer_from_gguf

# Dequantizable tensor types: the gguf package's numpy kernels plus plain floats.
SUPPORTED_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits.keys()}
)
GGUF_ARCHITECTURES = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Types the native quantized GEMM serves as stored (``--quantization gguf``): Q4_0 as
# Q4_1 with min -8 d, Q5_0 as Q8_0 with codes q - 16 (the same values: what llama.cpp
# writes for a Q4_K_M matrix whose rows are not a multiple of 256), Q4_K's sub-blocks as
# Q4_1 groups with float32 scales, Q6_K's as int8 codes with a float32 scale a 16, Q5_1's
# and Q5_K's as byte codes with a float32 scale and min (csrc/gemm_q_impl.h). Others (Q2_K,
# Q3_K, IQ*, ...) are dequantized at load.
SERVED_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                          GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                          GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
                          GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
SERVED_NAMES = "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K"


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A matrix as the file stores it: ``raw`` (N, K / 32 * block bytes) uint8, rows in
    HF order (llama.cpp's Q/K row permutation undone), ``qtype`` its ggml type code."""

    qtype: int
    raw: torch.Tensor
    k: int


class GgufModel:
    def __init__(self, path: Path) -> None:
        reader = GgufFile(path)
        self.meta: dict[str, Any] = reader.fields
        arch = str(self.meta.get("general.architecture", ""))
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModel(
                f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
                raise UnsupportedModel(
                    f"{path}: tensor {t.name} has quantization type {t.tensor_type.name}, "
                    f"which this loader cannot dequantize; supported: {names}"
                )
        self.config = self._config(arch)
        self.tokenizer = tokenizer_from_gguf(self.meta, self.config.vocab_size)

    def _config(self, arch: str) -> ModelConfig:
        m = self.meta

        def key(name: str, default: Any = None) -> Any:
            value = m.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedModel(f"GGUF metadata {arch}.{name} is missing")
            return value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = m.get(f"{arch}.vocab_size") or len(m["tokenizer.ggml.tokens"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_bias="blk.0.attn_output.bias" in self.tensors,
            rope_scaling=_rope_scaling(m, arch),
        )

    def state_dict(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Weights under HF names and layout, and llama 3 rope frequency factors if any."""
        state: dict[str, torch.Tensor] = {}
        freq_factors = None
        for name, t in self.tensors.items():
            w = torch.from_numpy(_dequantize(t))
            if name == "rope_freqs.weight":
                freq_factors = w
                continue
            hf_name, kind = _hf_name(name)
            if kind in ("attn_q", "attn_k") and self.config.architecture == "llama":
                heads = self.config.num_heads if kind == "attn_q" else self.config.num_kv_heads
                w = _unpermute(w, heads)
            state[hf_name] = w
        return state, freq_factors

    def quantized_weights(self) -> dict[str, QuantWeight]:
        """The 2-D weights of SERVED_TYPES under HF names, their bytes as stored (Q4_0's
        and Q5_0's as the Q4_1 and Q8_0 blocks of the same values)."""
        out: dict[str, QuantWeight] = {}
        for name, t in self.tensors.items():
            if t.tensor_type not in SERVED_TYPES or len(t.shape) != 2:
                continue
            data = np.array(t.data, dtype=np.uint8, order="C")
            qtype = int(t.tensor_type)
            if t.tensor_type == GGMLQuantizationType.Q4_0:
                as_q4_1 = q4_0_as_q4_1(data)
                if as_q4_1 is None:
                    continue  # a scale too large for the min -8 d: dequantized instead
                data, qtype = as_q4_1, int(GGMLQuantizationType.Q4_1)
            elif t.tensor_type == GGMLQuantizationType.Q5_0:
                data, qtype = q5_0_as_q8_0(data), int(GGMLQuantizationType.Q8_0)
            raw = torch.from_numpy(data)
            hf_name, kind = _hf_name(name)
            if kind in ("attn_q", "attn_k") and self.config.architecture == "llama":
                heads = self.config.num_heads if kind == "attn_q" else self.config.num_kv_heads
                raw = _unpermute(raw, heads).contiguous()  # whole rows move: bytes as stored
            out[hf_name] = QuantWeight(qtype, raw, int(t.shape[0]))
        return out


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows (blocks of f16 d, 4 bytes of fifth bits, 16 bytes of nibbles; value
    d (q - 16)) as Q8_0 rows (the same d, 32 int8 codes q - 16): the same values."""
    blocks = raw.reshape(raw.shape[0], -1, 22)
    out = np.empty((*blocks.shape[:2], 34), np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    # bit j of qh: element j's fifth bit; 1,024 rows at a time (the temporaries are a
    # few bytes a weight)
    bits = np.arange(32, dtype=np.uint32)
    for r in range(0, blocks.shape[0], 1024):
        b = blocks[r:r + 1024]
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")
        nib = np.concatenate([b[..., 6:22] & 0x0F, b[..., 6:22] >> 4], axis=-1)
        codes = (nib | (((qh >> bits) & 1).astype(np.uint8) << 4)).astype(np.int16) - 16
        out[r:r + 1024, :, 2:] = codes.astype(np.int8).view(np.uint8)
    return out.reshape(raw.shape[0], -1)


def q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """Q4_0 rows (blocks of f16 d + 16 bytes, value d (q - 8)) as Q4_1 rows (f16 d, f16 m,
    the same 16 bytes, value d q + m) with m = -8 d: exact in f16 (a power of two) but
    where 8 d overflows it (None then)."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)
    with np.errstate(over="ignore"):
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
    if not np.isfinite(m).all():
        return None
    out = np.concatenate([blocks[..., 0:2], m.view(np.uint8), blocks[..., 2:]], axis=-1)
    return np.ascontiguousarray(out.reshape(raw.shape[0], -1))


def _dequantize(t: GgufTensor) -> np.ndarray:
    # GGUF lists shapes innermost first; numpy wants them outermost first.
    shape = tuple(int(d) for d in reversed(t.shape))
    arr = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
    # F32 tensors come back as read-only views of the memory-mapped file.
    return np.array(arr, dtype=np.float32, order="C", copy=not arr.flags.writeable)


def _hf_name(name: str) -> tuple[str, str]:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], name
    m = _BLOCK_RE.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise UnsupportedModel(f"GGUF tensor {name!r} has no place in a Llama-family model")
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}", kind


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope_scaling(m: dict[str, Any], arch: str) -> dict[str, Any]:
    kind = m.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(m[f"{arch}.rope.scaling.factor"])}
    return {"rope_type": str(kind)}  # ModelConfig names it as unsupported
