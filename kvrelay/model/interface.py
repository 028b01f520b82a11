"""The contract between the model package and its users (server, relay, offline API).

The model package implements these; the server and the relay depend only on this
file, so they can be built and tested in parallel with the model itself.

KV cache layout (block-major), one tensor allocated once per engine:

    kv_cache.shape == (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)

One block is one contiguous piece of memory holding K and V of every layer, so a
transfer moves a request in one copy per block (DESIGN section 5). The runner
takes the tensor from ``kv_cache_factory`` when one is given (the relay's shm
transport hands out a tensor over shared memory), else allocates it with zeros.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvrelay.core.runner import Runner

KvCacheFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class KvGeometry:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the KV cache's: "float32" | "bfloat16" | "float16"
    layout: str = "block_major"
    # The model's dtype where the cache's differs (--kv-cache-dtype): KV a bfloat16
    # model computed is not what a float32 one would have, even in the same bytes.
    model_dtype: str = ""

    @property
    def block_bytes(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def compat_hash(self, model_id: str = "") -> str:
        """Two engines may exchange KV only when these hashes are equal."""
        text = "|".join(
            str(x)
            for x in (
                self.architecture,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                self.dtype,
                self.layout,
                model_id,
            )
        )
        if self.model_dtype not in ("", self.dtype):  # hashes as before where equal
            text += f"|model_dtype={self.model_dtype}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class Tokenizer(Protocol):
    eos_token_ids: Sequence[int]  # ids that end generation (eos and the chat end marker)
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str: ...


class LoadedModel(Protocol):
    name: str  # default served model name (e.g. "SmolLM2-135M-Instruct")
    tokenizer: Tokenizer
    runner: Runner  # owns kv_cache; implements kvrelay.core.runner.Runner
    kv_cache: torch.Tensor
    kv_geometry: KvGeometry
    num_blocks: int
    max_model_len: int
