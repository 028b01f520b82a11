"""What a KV block is, as two engines must agree on it before they exchange one: the
model's shape, the block size, the dtypes and the layout, and the hash that says so."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


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
