"""Which bytes of registered memory make up KV block ``b``: the layout a relay names.

kvrelay's own cache is block-major (``block_major``): block ``b`` is one contiguous
piece holding every layer's K and V. vLLM's CPU cache is layer-major: each layer is a
tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K and V fused in the
last dimension), all layers views of one storage, so block ``b`` is one piece of
``piece_bytes`` in each of ``regions`` layers, at ``b * piece_bytes`` into each.

``BlockLayout.name`` is what the HELLO carries and ``compat_hash`` covers, so a P and a
D that cut blocks differently are refused at HELLO with both layouts named. The tcp
stream of a READ is region by region, block by block within a region: a run of
consecutive block ids is one contiguous range per region, so each side moves it with
one iovec per region and run (tcp._views), however the other side's ids run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_MAJOR = "block_major"


@dataclass(frozen=True)
class BlockLayout:
    regions: int  # block b is one piece in each region
    piece_bytes: int  # 0 for block_major: the whole block, whatever its size

    @property
    def name(self) -> str:
        if self.regions == 1 and self.piece_bytes == 0:
            return BLOCK_MAJOR
        return f"regions:{self.regions}x{self.piece_bytes}"

    @classmethod
    def parse(cls, name: str) -> BlockLayout:
        if name == BLOCK_MAJOR:
            return cls(1, 0)
        kind, _, dims = name.partition(":")
        regions, _, piece = dims.partition("x")
        if kind != "regions" or not (regions.isdigit() and piece.isdigit()) or \
                int(regions) < 1 or int(piece) < 1:
            raise ValueError(f"KV layout {name!r}: expected {BLOCK_MAJOR!r} or "
                             "'regions:<count>x<piece bytes>'")
        return cls(int(regions), int(piece))


def layer_regions(kv_caches: Mapping[str, Any]) -> tuple[list[np.ndarray], BlockLayout]:
    """vLLM's per-layer KV tensors (host memory) as one (num_blocks, piece_bytes) uint8
    view per layer, in the model's layer order, and the layout they form. Raises
    ValueError naming the layer whose tensor does not cut into whole blocks."""
    import torch

    views: list[np.ndarray] = []
    num_blocks = piece = -1
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"KV layer {name}: the relay's tcp transport needs a cache in "
                             f"host memory, got {getattr(t, 'device', type(t).__name__)}")
        if not t.is_contiguous():
            raise ValueError(f"KV layer {name}: shape {tuple(t.shape)} strides "
                             f"{t.stride()} is not contiguous; one block must be one piece")
        nbytes = math.prod(t.shape[1:]) * t.element_size()
        if views and (t.shape[0], nbytes) != (num_blocks, piece):
            raise ValueError(f"KV layer {name}: {t.shape[0]} blocks of {nbytes} B, the "
                             f"first layer has {num_blocks} of {piece} B")
        num_blocks, piece = int(t.shape[0]), nbytes
        views.append(t.view(torch.uint8).reshape(num_blocks, piece).numpy())
    if not views:
        raise ValueError("no KV layers were registered")
    return views, BlockLayout(len(views), piece)
