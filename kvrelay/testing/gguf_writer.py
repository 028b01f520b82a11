"""Write a Llama model (HF names and layout) as a GGUF file, as llama.cpp's converter does.

Used by the test helpers; it returns the weights the file decodes to, so a test can
compare the GGUF loader against transformers run on exactly those weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

# Tensor type per GGUF tensor kind: every type the loader must read appears once.
_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.F16,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q8_0,
}
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Rows of w (K a multiple of 256) as Q4_K blocks, the layout ggml reads: per 256
    values f16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles
    (a 64-value chunk's first 32 in the low nibbles), value = d sc q - dmin m. A plain
    min/max quantizer (the gguf package has none for K types; llama.cpp's searches the
    scales), enough to write test files that llama.cpp would read alike."""
    rows, k = w.shape
    if k % 256:
        raise ValueError(f"Q4_K needs rows of a multiple of 256 values, got {k}")
    x = w.astype(np.float32).reshape(rows, k // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)),
                 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)),
                0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(x + (dminf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8).reshape(rows, k // 256, 4, 2, 32)
    packed = np.empty((rows, k // 256, 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, k // 256, 128)
    out = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8),
                          packed, qs], axis=-1)
    return out.reshape(rows, k // 256 * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Rows of w (K a multiple of 256) as Q6_K blocks, the layout ggml reads: per 256
    values 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one a 16
    values) and f16 d, value = d sc (q - 32). A plain max-abs quantizer, as quantize_q4_k."""
    rows, k = w.shape
    if k % 256:
        raise ValueError(f"Q6_K needs rows of a multiple of 256 values, got {k}")
    nb = k // 256
    x = w.astype(np.float32).reshape(rows, nb, 16, 16)
    scale = np.abs(x).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)),
                 -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.divide(x, step, out=np.zeros_like(x), where=step != 0)
    code = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(rows, nb, 2, 4, 32)
    q1, q2, q3, q4 = (code[:, :, :, t] for t in range(4))  # (rows, nb, half, 32)
    ql = np.concatenate([(q1 & 15) | ((q3 & 15) << 4), (q2 & 15) | ((q4 & 15) << 4)], axis=-1)
    qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out = np.concatenate([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64),
                          sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return out.reshape(rows, nb * 210)


def quantize_as(w: np.ndarray, qtype: Q) -> np.ndarray:
    """w's rows as GGUF blocks of qtype: the gguf package's quantizer, or ours for the K
    types it lacks (Q4_K, Q6_K)."""
    if qtype == Q.Q4_K:
        return quantize_q4_k(w)
    if qtype == Q.Q6_K:
        return quantize_q6_k(w)
    return np.ascontiguousarray(quantize(w, qtype))


# Served types whose every byte pattern is a valid block: (values a block, bytes a block,
# the bytes of its float16 scale, and min where it has one).
_ANY_BYTES = {Q.Q8_0: (32, 34, slice(0, 2)), Q.Q4_1: (32, 20, slice(0, 4)),
              Q.Q5_1: (32, 24, slice(0, 4)), Q.Q4_K: (256, 144, slice(0, 4)),
              Q.Q5_K: (256, 176, slice(0, 4)), Q.Q6_K: (256, 210, slice(208, 210))}


def random_blocks(qtype: Q, n: int, k: int, seed: int,
                  scales: tuple[float, float]) -> np.ndarray:
    """n rows of k values as random blocks of qtype, (n, bytes a row) uint8: every code,
    sub-block scale and min a quantizer may never write, with the float16 scales (and
    mins) drawn from ``scales`` so the values stay finite."""
    per, size, d_at = _ANY_BYTES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    d = rng.uniform(*scales, size=(n, k // per, (d_at.stop - d_at.start) // 2))
    blocks[..., d_at] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_HF_TO_GGUF[module]}.{parts[-1]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (rotate-half -> interleaved rotary pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    path: Path,
    cfg: dict[str, Any],
    weights: dict[str, np.ndarray],
    tokenizer_json: str,
    chat_template: str,
    types: dict[str, Q] | None = None,
) -> dict[str, np.ndarray]:
    """``types``: the tensor type per GGUF tensor kind, over the default (_TYPES)."""
    kinds = {**_TYPES, **(types or {})}
    writer = GGUFWriter(str(path), "llama")
    _write_metadata(writer, cfg)
    _write_tokenizer(writer, tokenizer_json, chat_template)
    decoded: dict[str, np.ndarray] = {}
    for hf, w in weights.items():
        name = gguf_name(hf)
        kind = name.split(".")[-2]
        qtype = kinds.get(kind, Q.F32) if w.ndim == 2 else Q.F32
        data = quantize_as(w, qtype)
        back = dequantize(data, qtype).reshape(w.shape).astype(np.float32)
        decoded[hf] = back
        if kind in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
            # Row permutation commutes with row-wise quantization blocks.
            data = permute(data, heads)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def _write_metadata(writer: GGUFWriter, cfg: dict[str, Any]) -> None:
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])


def _write_tokenizer(writer: GGUFWriter, tokenizer_json: str, chat_template: str) -> None:
    tj = json.loads(tokenizer_json)
    vocab: dict[str, int] = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj.get("added_tokens", []) if a.get("special")}
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
