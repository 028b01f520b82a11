"""What a KV block is, as two engines must agree on it before they exchange one: the
model's shape, the block size, the dtypes and the layout, and the hash that says so."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# --kv-cache-dtype fp8_e4m3: each head's row of a token is head_dim e4m3 codes and a
# float16 scale (per token and head), inline, so a block is one piece of bytes and moves
# as one; SCALE_LAYOUTS names that layout in the compat hash.
FP8_SCALE_BYTES = 2
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}
SCALE_LAYOUTS = {"fp8_e4m3": "scale=f16/token,head;inline"}


@dataclass(frozen=True)
class KvGeometry:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the KV cache's: "float32" | "bfloat16" | "float16" | "fp8_e4m3"
    layout: str = "block_major"
    # The model's dtype where the cache's differs (--kv-cache-dtype): KV a bfloat16
    # model computed is not what a float32 one would have, even in the same bytes.
    model_dtype: str = ""

    @property
    def head_elems(self) -> int:
        """A head's elements in a token's cache row: head_dim, and an 8-bit cache's scale."""
        return self.head_dim + (FP8_SCALE_BYTES if self.dtype in SCALE_LAYOUTS else 0)

    @property
    def scale_layout(self) -> str:
        """Where an 8-bit cache keeps its scales ("" for a cache without any)."""
        return SCALE_LAYOUTS.get(self.dtype, "")

    @property
    def block_bytes(self) -> int:
        itemsize = _ITEMSIZE[self.dtype]
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_elems
                * itemsize)

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
        if self.scale_layout:  # only 8-bit caches have one: the others hash as before
            text += f"|{self.scale_layout}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]
