"""Load a Hugging Face model directory: config.json, safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HfTokenizer

from kvrelay.model.config import ModelConfig
from kvrelay.model.text.tokenizer import Tokenizer


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
    cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:  # sharded checkpoints: every shard holds a disjoint set of names
        state.update(load_file(str(f)))
    return cfg, state, load_hf_tokenizer(path, cfg.vocab_size)


def load_hf_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{path}: tokenizer.json is missing")
    tcfg = _read_json(path / "tokenizer_config.json")
    template = _chat_template(path, tcfg)
    gen = _read_json(path / "generation_config.json")
    extra = gen.get("eos_token_id")
    extra_ids = [extra] if isinstance(extra, int) else list(extra or [])
    return Tokenizer(
        HfTokenizer.from_file(str(tok_file)),
        vocab_size=vocab_size,
        chat_template=template,
        bos_token=_token_text(tcfg.get("bos_token")),
        eos_token=_token_text(tcfg.get("eos_token")),
        extra_eos_ids=extra_ids,
    )


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _chat_template(path: Path, tcfg: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):
        return str(tok.get("content"))
    return tok if isinstance(tok, str) else None
