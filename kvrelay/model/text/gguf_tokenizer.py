"""Build a ``tokenizers`` tokenizer from GGUF metadata (byte-level BPE, llama.cpp "gpt2")."""

from __future__ import annotations

import warnings
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer

from kvrelay.model.config import UnsupportedModel
from kvrelay.model.text.tokenizer import Tokenizer

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer splits by llama.cpp "pre" name (the regexes of llama-vocab.cpp).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")


def tokenizer_from_gguf(meta: dict[str, Any], vocab_size: int) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedModel(
            f"GGUF tokenizer model {kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = HfTokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == _USER_DEFINED])
    bos = _token(tokens, meta.get("tokenizer.ggml.bos_token_id"))
    eos = _token(tokens, meta.get("tokenizer.ggml.eos_token_id"))
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id",) if meta.get(k) is not None]
    return Tokenizer(
        tok,
        vocab_size=vocab_size,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        extra_eos_ids=[int(x) for x in extra],
    )


def _token(tokens: list[str], token_id: object) -> str | None:
    if isinstance(token_id, int) and 0 <= token_id < len(tokens):
        return tokens[token_id]
    return None


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "qwen2": _QWEN2}.get(pre)
    if regex is not None:
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    if pre not in ("default", "gpt2"):
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known; using GPT-2's split", stacklevel=2)
    return byte_level
