"""The native GEMMs behind ``model.Linear``: the small-M bfloat16 and float32 kernels,
the AMX bfloat16 GEMM, and GGUF codes served as stored (one kernel per type, or one call
per part where a fused weight's parts differ in type)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvrelay import env
from kvrelay.model.kernels.backend import EVERY_ROWS

if TYPE_CHECKING:
    from kvrelay.model.formats.gguf_loader import QuantWeight

# Rows up to which each native small-M GEMM beats oneDNN's packed GEMM (docs/model.md,
# "Decode GEMMs"): bfloat16 up to 128 rows, float32 on par at 32 and behind from 64.
BF16_GEMM_ROWS = 128
F32_GEMM_ROWS = 32
# Where the CPU has AMX-BF16, bfloat16 calls of AMX_GEMM_ROWS rows or more run on AMX
# tiles (csrc/gemm_bf16_amx.cpp), fewer on vdpbf16ps; between them they take every call.
# KVRELAY_AMX_GEMM=0 turns the AMX kernel off.
AMX_GEMM_ROWS = 5
# The quantized GEMM serves every call, prefill chunks too, for every dtype and ISA: a
# token's output row is then a function of its input row and the codes alone, whatever
# the call's row count, the chunk or the batch (csrc/gemm_q_impl.h quantizes each row on
# its own and sums every row in one order), so a prompt answers the same cold, after a
# cached prefix, chunked or through P/D (docs/model.md, "One answer per request").
# oneDNN or the AMX GEMM for the large calls were faster in bfloat16 but computed those
# rows otherwise.
GGUF_GEMM_ROWS_EVERY = EVERY_ROWS


class NativeSmallGemm:
    """y = x W^T + b for a few rows (csrc/gemm_bf16.cpp, csrc/gemm_f32_impl.h): the
    weight packed once into the kernel's layout, each byte of it read once per call,
    columns split across the threads. bfloat16: AVX-512 BF16 ``vdpbf16ps``; float32:
    AVX-512 or AVX2 + FMA, whichever the kernels run with (``KVRELAY_NATIVE_ISA=avx2``
    forces AVX2). ``amx`` (bfloat16): every call, on AMX tiles from AMX_GEMM_ROWS rows."""

    def __init__(self, mod: Any, dtype: torch.dtype, amx: bool = False) -> None:
        self.dtype = dtype
        self.amx = amx and dtype is torch.bfloat16
        if dtype is torch.bfloat16:
            self._pack, self.run = mod.pack_bf16_gemm, mod.bf16_gemm
            self._small = mod.bf16_gemm  # below AMX_GEMM_ROWS; with silu=True, run_silu
            self.label, self.max_rows = "native-bf16", BF16_GEMM_ROWS
            if amx:  # every call: AMX tiles from AMX_GEMM_ROWS rows on (K % 32 == 0)
                self._amx = mod.bf16_gemm_amx
                self.run = self._run_amx
                self.label, self.max_rows = "native-bf16-amx", EVERY_ROWS
        else:
            self._pack, self.run = mod.pack_f32_gemm, mod.f32_gemm
            self._small = mod.f32_gemm
            self.label, self.max_rows = f"native-f32-{mod.isa()}", F32_GEMM_ROWS

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        if weight.dtype is not self.dtype or weight.dim() != 2:
            return None
        if self.dtype is torch.bfloat16 and weight.shape[1] % 2:
            return None  # vdpbf16ps takes k in pairs
        packed: torch.Tensor = self._pack(weight.contiguous())
        return packed

    def rows_for(self, weight: torch.Tensor) -> int:
        """max_rows for this weight: the AMX tiles take K in 32s; with another K the
        vdpbf16ps kernel keeps its own limit and oneDNN the calls above it."""
        if self.amx and weight.shape[1] % 32:
            return BF16_GEMM_ROWS
        return self.max_rows

    def _run_amx(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        amx = x.shape[0] >= AMX_GEMM_ROWS and x.shape[1] % 32 == 0
        y: torch.Tensor = (self._amx if amx else self._small)(x, packed, n, bias)
        return y

    def run_silu(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
        """silu(gate) * up of a fused (gate, up) weight of n = 2I rows, from the AMX
        tiles' epilogue (without writing and reading back the (rows, 2I) product) or, on
        the other small-M kernels, from each thread's own columns as it finishes them
        (one call and one pass less): the values silu_mul gives of run's output. None
        where I is not a multiple of 16."""
        if n % 32:
            return None
        amx = self.amx and x.shape[0] >= AMX_GEMM_ROWS and x.shape[1] % 32 == 0
        y: torch.Tensor = (self._amx if amx else self._small)(x, packed, n, bias, True)
        return y


def amx_gemm_unavailable(mod: Any, dtype: torch.dtype) -> str | None:
    """Why bfloat16 GEMMs do not run on the native AMX kernel, or None when they do."""
    if dtype is not torch.bfloat16:
        return f"{dtype} (it takes bfloat16)"
    if not env.get("KVRELAY_AMX_GEMM"):
        return "KVRELAY_AMX_GEMM=0"
    if not mod.has_amx_bf16_gemm():
        return "the CPU lacks AMX-BF16 (or the kernels run as AVX2)"
    return None


def small_gemm_unavailable(mod: Any, dtype: torch.dtype) -> str | None:
    """Why the native small-M GEMM is not used, or None when it is."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} (it takes bfloat16 or float32)"
    if not env.get("KVRELAY_NATIVE_GEMM"):
        return "KVRELAY_NATIVE_GEMM=0"
    if dtype is torch.bfloat16 and not mod.has_bf16_gemm():
        return "the CPU lacks AVX-512 BF16"
    if dtype is torch.float32 and not mod.has_f32_gemm():
        return "the CPU lacks AVX2 + FMA"
    return None


class NativeGgufGemm:
    """y = x W^T + b with W as a GGUF file stores it (Q8_0, Q4_1, Q4_K or Q6_K codes,
    repacked into 16-column groups; csrc/gemm_q_impl.h): a decode step streams 5-10 bits a
    weight instead of 32 (float32) or 16 (bfloat16). x (float32 or bfloat16) is quantized
    to 8 bits per 32 values and multiplied in integers (AVX-512 VNNI or AVX2), llama.cpp's
    route; the result in x's dtype."""

    def __init__(self, mod: Any, qtype: int, label: str, max_rows: int) -> None:
        """``max_rows``: GgufGemms' choice for the model."""
        self._mod, self.qtype, self.label, self.max_rows = mod, qtype, label, max_rows

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        return None  # its weights come packed from the file's codes (pack_raw)

    def rows_for(self, weight: torch.Tensor) -> int:
        return self.max_rows

    def run_silu(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
        """silu(gate) * up from each thread's own columns (NativeSmallGemm.run_silu)."""
        if n % 32:
            return None
        y: torch.Tensor = self._mod.gguf_gemm(x, packed, self.qtype, n, bias, True)
        return y

    def pack_raw(self, raw: torch.Tensor, k: int) -> torch.Tensor:
        packed: torch.Tensor = self._mod.pack_gguf_gemm(raw, self.qtype, k)
        return packed

    def run(self, x: torch.Tensor, packed: torch.Tensor, n: int,
            bias: torch.Tensor | None) -> torch.Tensor:
        y: torch.Tensor = self._mod.gguf_gemm(x, packed, self.qtype, n, bias)
        return y


class NativeGgufParts:
    """A fused Linear whose parts are stored in different served types (a Q4_K_M file's
    q and k in Q4_K beside v in Q6_K in some layers): one quantized GEMM per run of parts
    of one type, their packed codes in one flat uint8 tensor (each run at a 64-byte
    offset), the outputs side by side. Without it such a Linear kept the float weight."""

    def __init__(self, mod: Any, runs: Sequence[tuple[int, int, int, tuple[int, ...]]],
                 label: str, max_rows: int) -> None:
        """``runs``: (qtype, output columns, byte offset, packed shape) each."""
        self._mod, self._runs, self.label, self.max_rows = mod, list(runs), label, max_rows

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        return None  # packed by GgufGemms.pack

    def rows_for(self, weight: torch.Tensor) -> int:
        return self.max_rows

    def run_silu(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
        return None  # gate and up apart: silu_mul of run's output

    def run(self, x: torch.Tensor, packed: torch.Tensor, n: int,
            bias: torch.Tensor | None) -> torch.Tensor:
        ys, col = [], 0
        for qtype, cols, off, shape in self._runs:
            w = packed[off:off + math.prod(shape)].view(shape)
            b = None if bias is None else bias[col:col + cols]
            ys.append(self._mod.gguf_gemm(x, w, qtype, cols, b))
            col += cols
        return torch.cat(ys, dim=1)


class GgufGemms:
    """The quantized GEMMs of one model: ``pack(names)`` gives a (fused) Linear's kernel
    and packed codes when all its parts are stored in served types (NativeGgufParts where
    they differ), else None."""

    def __init__(self, mod: Any, quantized: Mapping[str, QuantWeight]) -> None:
        self.label = f"native-gguf-{mod.gguf_isa()}"
        self._mod, self._quantized = mod, quantized
        self._max_rows = GGUF_GEMM_ROWS_EVERY
        self._kernels: dict[int, NativeGgufGemm] = {}

    def pack(self, names: Sequence[str]
             ) -> tuple[NativeGgufGemm | NativeGgufParts, torch.Tensor] | None:
        parts = [self._quantized.get(n) for n in names]
        if any(p is None for p in parts):
            return None
        qws = [p for p in parts if p is not None]
        if len({q.k for q in qws}) != 1:
            return None
        if len({q.qtype for q in qws}) != 1:
            return self._pack_parts(qws)
        qtype, k = qws[0].qtype, qws[0].k
        kernel = self._kernels.setdefault(
            qtype, NativeGgufGemm(self._mod, qtype, self.label, self._max_rows))
        raw = qws[0].raw if len(qws) == 1 else torch.cat([q.raw for q in qws])
        return kernel, kernel.pack_raw(raw, k)

    def _pack_parts(self, qws: Sequence[QuantWeight]) -> tuple[NativeGgufParts, torch.Tensor]:
        runs, flats, off = [], [], 0
        for qtype, group in itertools.groupby(qws, key=lambda q: q.qtype):
            raw = torch.cat([q.raw for q in group])
            packed = self._mod.pack_gguf_gemm(raw, qtype, qws[0].k)
            runs.append((qtype, raw.shape[0], off, tuple(packed.shape)))
            pad = -packed.numel() % 64
            flats += [packed.view(-1), packed.new_zeros(pad)]
            off += packed.numel() + pad
        return NativeGgufParts(self._mod, runs, self.label, self._max_rows), torch.cat(flats)
