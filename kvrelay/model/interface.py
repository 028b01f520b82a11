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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from kvrelay.core.runner import Runner
from kvrelay.relay.geometry import KvGeometry

KvCacheFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


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
