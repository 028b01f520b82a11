"""The kernel seam: one interface, with the pure-torch kernels and the native CPU
kernels (native.py) as peers behind it; a CUDA backend plugs in the same way.

A backend owns what differs between implementations of a layer's non-GEMM work:
the step's attention metadata, rope + KV write + paged attention, RMSNorm (fused
with the residual add) and silu * mul. The GEMMs stay in model.py (oneDNN on CPU).

Chosen once per model at load (``select_backend``): ``KVRELAY_KERNELS`` = ``auto``
(native where it loads and supports the dtype and device, else torch), ``native``
(the same, but a warning when it cannot) or ``torch``. The choice is logged and
exported on /metrics (``kvrelay_kernels_info``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels.attention import (
    AttnMetadata,
    ChunkSpec,
    build_metadata,
    paged_attention,
    static_decode_metadata,
)
from kvrelay.model.kernels.rope import RotaryTable

if TYPE_CHECKING:
    from kvrelay.model.formats.gguf_loader import QuantWeight


KERNEL_CHOICES = ("auto", "native", "torch")
EVERY_ROWS = 1 << 30  # a GEMM whose max_rows is this takes every call, oneDNN none


class StepMetadata(Protocol):
    """What a backend precomputes once per step for every layer's attention."""


class KernelBackend(Protocol):
    name: str  # "torch" | "native" (| "cuda")
    isa: str  # the instruction set the kernels run with; "" when not applicable
    # Serves GGUF codes as stored (``--quantization auto`` takes them only then).
    serves_quantized: bool
    gemm_off: str | None  # why small_gemm() is None; None when there is one

    def build_metadata(
        self, chunks: Sequence[ChunkSpec], positions: torch.Tensor, block_size: int
    ) -> StepMetadata: ...

    def attention(
        self, qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: StepMetadata
    ) -> torch.Tensor:
        """qkv: (T, (H + 2 KVH) D), the fused projection (the backend may overwrite
        it). Applies rope to q and k, writes k and v into ``layer`` of the block-major
        cache, returns attention output (T, H D)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(
        self, h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """``h += r`` in place (the residual stream), then returns rms_norm(h)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) -> (T, I): silu(gate) * up."""
        ...

    def small_gemm(self) -> SmallGemm | None:
        """A GEMM for decode-sized row counts that model.Linear runs instead of
        oneDNN's (native: bfloat16 with AVX-512 BF16, float32 with AVX-512 or AVX2),
        or None."""
        ...

    def quantized_gemms(self, quantized: Mapping[str, QuantWeight]) -> QuantGemms:
        """``--quantization gguf``: the GEMMs that serve ``quantized`` as stored, or a
        ValueError that says why this backend cannot."""
        ...


class QuantGemms(Protocol):
    label: str  # e.g. native-gguf-avx2

    def pack(self, names: Sequence[str]) -> tuple[SmallGemm, torch.Tensor] | None:
        """A (fused) Linear's kernel and packed codes when all its parts are stored in
        served types, else None (the float weight is used)."""
        ...


class SmallGemm(Protocol):
    label: str  # for the log and the ``gemm`` label of kvrelay_kernels_info
    max_rows: int  # calls of more rows go to oneDNN

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight (N, K) in the kernel's layout, or None if it cannot take it."""
        ...

    @property
    def run(self) -> Callable[..., torch.Tensor]:
        """run(x (M, K), packed, N, bias or None) -> (M, N) in x's dtype."""
        ...

    def rows_for(self, weight: torch.Tensor) -> int:
        """max_rows for this weight (a kernel may take fewer rows of some shapes)."""
        ...

    def run_silu(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
        """silu(gate) * up of a fused (gate, up) weight of n = 2I rows in one pass, or
        None where the kernel does not fuse it (the caller then runs run and silu_mul)."""
        ...


class GraphableBackend(KernelBackend, Protocol):
    """A backend whose decode steps a CUDA graph can capture (graphs.py): its step
    metadata is computed from fixed-shape device tensors by device ops only."""

    def static_decode_metadata(
        self,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> StepMetadata:
        """See attention.static_decode_metadata; ``positions`` (B,) for rope."""
        ...


def supports_graphs(backend: KernelBackend) -> bool:
    return callable(getattr(backend, "static_decode_metadata", None))


class TorchStep:
    __slots__ = ("attn", "cos", "sin")

    def __init__(self, attn: AttnMetadata, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.attn = attn
        self.cos = cos
        self.sin = sin


class TorchBackend:
    """The reference: ATen ops only, runs on any device and dtype."""

    name = "torch"
    isa = ""
    serves_quantized = False
    gemm_off: str | None = "not the native backend"

    def __init__(self, cfg: ModelConfig, rope: RotaryTable, dtype: torch.dtype,
                 native_off: str = "the torch kernels were chosen") -> None:
        self.native_off = native_off  # why the native kernels do not run (for errors)
        self.cfg = cfg
        self.rope = rope
        self.dtype = dtype
        self._split = [(cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim,
                       cfg.num_kv_heads * cfg.head_dim]

    def build_metadata(
        self, chunks: Sequence[ChunkSpec], positions: torch.Tensor, block_size: int
    ) -> TorchStep:
        cfg = self.cfg
        attn = build_metadata(
            chunks, block_size, cfg.num_layers, cfg.num_kv_heads, positions.device, self.dtype
        )
        cos, sin = self.rope.lookup(positions)
        return TorchStep(attn, cos, sin)

    def static_decode_metadata(
        self,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> TorchStep:
        cfg = self.cfg
        attn = static_decode_metadata(
            block_tables, context_lens, slot_mapping, block_size, cfg.num_layers,
            cfg.num_kv_heads, self.dtype,
        )
        cos, sin = self.rope.lookup(positions)
        return TorchStep(attn, cos, sin)

    def attention(
        self, qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: StepMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, TorchStep)
        cfg = self.cfg
        T, D = qkv.shape[0], cfg.head_dim
        qk, v = qkv.split(self._split, dim=-1)
        # q and k are adjacent in the fused projection: rotate them together.
        qk = self.rope.apply(qk.view(T, cfg.num_heads + cfg.num_kv_heads, D), meta.cos, meta.sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.view(T, cfg.num_kv_heads, D)
        kv_rows = kv_cache.view(-1, cfg.num_kv_heads * D)
        return paged_attention(q, k, v, kv_rows, layer, meta.attn)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As in transformers: normalize in float32, cast back, then scale. rms_norm of
        # a bfloat16 tensor computes in float32 inside and rounds once, which is the
        # same as casting around it, without two copies.
        shape, eps = (x.shape[-1],), self.cfg.rms_norm_eps
        if x.dtype is torch.float32:
            return F.rms_norm(x, shape, weight, eps)
        return weight * F.rms_norm(x, shape, None, eps)

    def add_rms_norm(
        self, h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        h += r
        return self.rms_norm(h, weight)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def small_gemm(self) -> SmallGemm | None:
        return None

    def quantized_gemms(self, quantized: Mapping[str, QuantWeight]) -> QuantGemms:
        raise ValueError(f"--quantization gguf needs the native kernels (AVX2 + FMA or "
                         f"AVX-512) and cannot use them: {self.native_off}")
