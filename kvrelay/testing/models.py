"""Tiny random models for tests, written through the formats the loaders read.

``write_tiny_hf_model`` writes a Hugging Face directory (config.json, safetensors,
tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json);
``write_tiny_gguf`` writes the same kind of model as a GGUF file with a mix of
tensor types and llama.cpp's Q/K permutation. Both load in well under a second and
need nothing from a hub: the tokenizer is a byte-level BPE trained on a fixed text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

TINY_ARCHS = ("llama", "llama3", "qwen2", "mistral")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? "
    "Paris is the capital of France. Hello world, naïve café, 日本語 and 😀 emoji. "
    "Once upon a time there was a small model that answered every question.\n"
)
_DIMS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "max_pos": 512}


def tiny_tokenizer_json() -> str:
    """A deterministic byte-level BPE (a few hundred tokens), as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 10, trainer)
    return str(tok.to_str())


def tiny_hf_config(arch: str, vocab_size: int) -> dict[str, Any]:
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch {arch!r}: choose one of {', '.join(TINY_ARCHS)}")
    model_type = "llama" if arch == "llama3" else arch
    d = _DIMS
    cfg: dict[str, Any] = {
        "architectures": [
            {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[model_type] + "ForCausalLM"
        ],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": d["hidden"],
        "intermediate_size": d["intermediate"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["hidden"] // d["heads"],
        "hidden_act": "silu",
        "max_position_embeddings": d["max_pos"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        # Qwen2 ties its embeddings in the small sizes; keep Llama untied to cover both.
        "tie_word_embeddings": model_type == "qwen2",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if arch == "llama3":
        # Short original context so the scaling changes frequencies the test reaches.
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    if model_type == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=d["layers"])
    if model_type == "mistral":
        cfg["sliding_window"] = None
    return cfg


def tiny_weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights under HF names: std 0.1 matrices, norms near 1."""
    rng = np.random.default_rng(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.standard_normal(h) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[p + f"self_attn.{name}.weight"] = mat(rows, h)
            if cfg["model_type"] == "qwen2":
                w[p + f"self_attn.{name}.bias"] = mat(1, rows)[0]
        w[p + "self_attn.o_proj.weight"] = mat(h, q)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter)
    w["model.norm.weight"] = norm()
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(v, h)
    return w


def write_hf_dir(
    dir: Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], tokenizer_json: str
) -> Path:
    import torch
    from safetensors.torch import save_file

    dir.mkdir(parents=True, exist_ok=True)
    (dir / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(
        {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in weights.items()},
        str(dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (dir / "tokenizer.json").write_text(tokenizer_json)
    (dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[BOS_ID],
                "eos_token": SPECIAL_TOKENS[EOS_ID],
                "pad_token": SPECIAL_TOKENS[0],
                "model_max_length": cfg["max_position_embeddings"],
                "chat_template": CHATML_TEMPLATE,
            },
            indent=1,
        )
    )
    (dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
    return dir


def write_tiny_hf_model(dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny random model (2 layers, hidden 64, 4 heads, 2 KV heads) as an HF directory.

    ``arch``: "llama", "llama3" (llama with Llama 3 rope scaling), "qwen2", "mistral".
    """
    tok = tiny_tokenizer_json()
    vocab = len(json.loads(tok)["model"]["vocab"])
    cfg = tiny_hf_config(arch, vocab)
    return write_hf_dir(Path(dir), cfg, tiny_weights(cfg, seed), tok)


def write_tiny_gguf(path: Path, seed: int = 0, *, reference_dir: Path | None = None,
                    k_quants: bool = False, types: dict[str, Any] | None = None) -> Path:
    """A tiny random llama model as GGUF, with F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors.

    With ``reference_dir``, also writes an HF directory holding exactly the weights
    the GGUF file decodes to (after quantization), for comparison with transformers.
    ``k_quants``: a wider model (hidden 256, intermediate 512: K-quant super-blocks are
    256 values) typed as llama.cpp's Q4_K_M mix: q, k, gate and up Q4_K, v, down and the
    output Q6_K (so q/k/v mixes types), o Q5_0 (llama.cpp's Q4_K stand-in where rows are
    not a multiple of 256), the embedding Q4_0. ``types``: GGUF tensor kinds typed
    otherwise (``gguf.GGMLQuantizationType`` each), over either.
    """
    from gguf import GGMLQuantizationType as Q

    from kvrelay.testing.gguf_writer import write_gguf

    tok = tiny_tokenizer_json()
    vocab = len(json.loads(tok)["model"]["vocab"])
    cfg = tiny_hf_config("llama", vocab)
    kinds: dict[str, Any] = {}
    if k_quants:
        cfg.update(hidden_size=256, intermediate_size=512,
                   head_dim=256 // cfg["num_attention_heads"])
        kinds = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0,
                 "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K,
                 "output": Q.Q6_K, "token_embd": Q.Q4_0}
    kinds.update(types or {})
    decoded = write_gguf(Path(path), cfg, tiny_weights(cfg, seed), tok, CHATML_TEMPLATE,
                         kinds or None)
    if reference_dir is not None:
        write_hf_dir(Path(reference_dir), cfg, decoded, tok)
    return Path(path)
