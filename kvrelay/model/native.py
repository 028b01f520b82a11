"""The native CPU backend: kvrelay/model/csrc (C++, OpenMP), built ahead of time by
``make`` into ``kvrelay/model/_native*.so`` against the installed torch.

Per layer it runs three parallel regions besides the GEMMs: rope + KV write +
paged attention (K/V read in place from the block-major cache, GQA, decode rows and
prefill chunks in one call), residual add + RMSNorm, silu * mul. The pure-torch
path runs wherever this one cannot: extension missing or built for another torch
(import fails), a CPU without AVX2, a dtype other than float32/bfloat16, a device
other than the CPU, or a self-check at load that disagrees with torch.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvrelay.model.attention import ChunkSpec
from kvrelay.model.backend import StepMetadata
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryTable

if TYPE_CHECKING:
    from kvrelay.model.gguf_loader import QuantWeight

_module: ModuleType | None = None
_load_error: str | None = None


# The bindings' version (csrc/bindings.cpp, m.attr("API")): 2 since attention() takes
# skip_from and skip_tokens (ints) where it took skip_fresh (a bool).
API = 2


def load() -> ModuleType | None:
    """The extension module, imported once; None (with ``load_error()``) if it fails."""
    global _module, _load_error
    if _module is None and _load_error is None:
        try:
            _native = importlib.import_module("kvrelay.model._native")
            built = getattr(_native, "API", 1)
            if built != API:
                _load_error = (f"extension built from other sources (bindings API {built}, "
                               f"this kvrelay needs {API}); rebuild it with `make`")
            elif _native.isa() == "none":
                _load_error = "the CPU has neither AVX2 nor AVX-512"
            else:
                _module = _native
        except ImportError as e:  # not built, or built against another torch
            _load_error = f"extension not loadable ({e}); build it with `make`"
    return _module


def load_error() -> str | None:
    load()
    return _load_error


def unavailable(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the native kernels cannot run this model, or None when they can."""
    if cfg.head_dim % 16 or cfg.head_dim > 512:
        return f"native attention needs head_dim a multiple of 16 up to 512, not {cfg.head_dim}"
    if device.type != "cpu":
        return f"native kernels are CPU-only, the model is on {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"native kernels take float32 or bfloat16, not {dtype}"
    mod = load()
    if mod is None:
        return _load_error
    return _self_check(mod, dtype)


def _self_check(mod: Any, dtype: torch.dtype) -> str | None:
    """A tiny RMSNorm and silu * mul against torch: catches a broken build at load."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(dtype)
    w = torch.rand(64, generator=g).to(dtype)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
    silu = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    if not torch.allclose(mod.rms_norm(x, w, 1e-6), ref, rtol=tol, atol=tol):
        return "native RMSNorm disagrees with torch at load"
    if not torch.allclose(mod.silu_mul(x), silu, rtol=tol, atol=tol):
        return "native silu * mul disagrees with torch at load"
    return None


# Rows up to which each native small-M GEMM beats oneDNN's packed GEMM (docs/model.md,
# "Decode GEMMs"): bfloat16 up to 128 rows, float32 on par at 32 and behind from 64.
BF16_GEMM_ROWS = 128
F32_GEMM_ROWS = 32
# Where the CPU has AMX-BF16, bfloat16 calls of AMX_GEMM_ROWS rows or more run on AMX
# tiles (csrc/gemm_bf16_amx.cpp), fewer on vdpbf16ps; between them they take every call.
# Beside a GGUF's codes (VNNI), AMX takes the calls above GGUF_AMX_ROWS rows, where it
# streams the bfloat16 weights faster than VNNI computes on the codes (docs/model.md,
# "AMX GEMM"). KVRELAY_AMX_GEMM=0 turns the AMX kernel off.
AMX_GEMM_ROWS = 5
GGUF_AMX_ROWS = 12
# The quantized GEMM serves every call, prefill chunks too (GGUF_GEMM_ROWS_EVERY), under
# AVX2 (on the AVX2-only EPYC 1.7-3.4x oneDNN's float32 GEMM per layer at 32-256 rows)
# and with AVX-512 VNNI for float32 activations (8 x 128-token prefills 0.76-0.99 s
# against 1.07-1.39 s on oneDNN's float32 GEMM, a Xeon without AMX; oneDNN's float32
# GEMM takes no AMX either): a row's result then never depends on the batch it ran in,
# nor on the CPU's oneDNN kernels. With VNNI and bfloat16 activations, where oneDNN has
# AMX or AVX-512 BF16 for prefill (not measured against it), up to F32_GEMM_ROWS.
GGUF_GEMM_ROWS_EVERY = 1 << 30
EVERY_ROWS = GGUF_GEMM_ROWS_EVERY  # a kernel with this max_rows takes every call


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
    if os.environ.get("KVRELAY_AMX_GEMM", "1") == "0":
        return "KVRELAY_AMX_GEMM=0"
    if not mod.has_amx_bf16_gemm():
        return "the CPU lacks AMX-BF16 (or the kernels run as AVX2)"
    return None


def small_gemm_unavailable(mod: Any, dtype: torch.dtype) -> str | None:
    """Why the native small-M GEMM is not used, or None when it is."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} (it takes bfloat16 or float32)"
    if os.environ.get("KVRELAY_NATIVE_GEMM", "1") == "0":
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

    def __init__(self, mod: Any, quantized: Mapping[str, QuantWeight],
                 dtype: torch.dtype, amx: bool = False) -> None:
        """``amx``: the AMX GEMM takes the calls above the codes' rows."""
        self.label = f"native-gguf-{mod.gguf_isa()}"
        self._mod, self._quantized = mod, quantized
        self.every = mod.gguf_isa() == "avx2" or dtype is torch.float32  # serve every call
        self._max_rows = (GGUF_GEMM_ROWS_EVERY if self.every
                          else GGUF_AMX_ROWS if amx else F32_GEMM_ROWS)
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


def gguf_gemms(backend: Any, quantized: Mapping[str, QuantWeight]) -> GgufGemms:
    """``--quantization gguf``: the native backend's quantized GEMMs, or a ValueError
    that says why they cannot run."""
    if not isinstance(backend, NativeBackend):
        why = load_error() or f"the {backend.name} kernels were chosen"
        raise ValueError(f"--quantization gguf needs the native kernels (AVX2 + FMA or "
                         f"AVX-512) and cannot use them: {why}")
    return GgufGemms(backend._ops, quantized, backend.dtype, amx=backend.amx_off is None)


# Where prompt chunks leave the native tiles for torch's SDPA: a chunk that attends to at
# least this many positions (its cached context and its own tokens), by the model's
# dtype. The tiles' cost per query grows with the context faster than SDPA's, and SDPA
# costs more per call. One prefill step, 30 layers, 2 threads, attention ms tiles / SDPA
# (docs/model.md, "Prompt attention by length", has the whole table): float32 on an AMX
# Xeon 8 x 128 tokens 88 / 130, 1 x 640 171 / 173, 1 x 768 239 / 210, 1 x 2,000
# 1,520 / 954 (held to AVX2: 114 / 142 at 8 x 128, 287 / 267 at 768); bfloat16 without
# AMX 4 x 256 105 / 110, 2 x 384 107 / 95. bfloat16 on a CPU with AMX-BF16: SDPA (on
# AMX itself) for every chunk, or the AMX kernel where it can (prefill_amx_available).
# A chunk of fewer than SDPA_MIN_TOKENS tokens stays on the tiles however long its
# context: SDPA gathers the whole context's K/V for it. Prompts after a cached prefix,
# 30 layers, 2 threads, attention ms tiles / SDPA (docs/model.md): float32 on the AMX
# Xeon 4 x 20 tokens after 1,504 28 / 80, 4 x 64 after 1,008 55 / 78, 4 x 128 after
# 1,504 389 / 346, 2 x 256 after 608 249 / 197; held to AVX2 and in bfloat16 without
# AMX the same sides.
SDPA_FROM = {torch.float32: 640, torch.bfloat16: 320}
SDPA_MIN_TOKENS = 128
EVERY_PROMPT_CHUNK = 2  # a prompt chunk has two tokens or more, so attends to 2 or more
NEVER = 1 << 62  # no chunk attends to this many positions


def prefill_sdpa_from(dtype: torch.dtype) -> int | None:
    """From how many attended positions a prompt chunk goes to torch's SDPA instead of the
    native tiles, or None for never (KVRELAY_PREFILL_SDPA=1: every prompt chunk, =0:
    none; default: SDPA_FROM by dtype, every chunk for bfloat16 on AMX-BF16)."""
    env = os.environ.get("KVRELAY_PREFILL_SDPA")
    if env in ("0", "1"):
        return EVERY_PROMPT_CHUNK if env == "1" else None
    from kvrelay.model.loader import CPUINFO

    if dtype is torch.bfloat16:
        try:
            if "amx_bf16" in CPUINFO.read_text().split():
                return EVERY_PROMPT_CHUNK
        except OSError:
            pass
    return SDPA_FROM.get(dtype)


class NativeStep:
    """Per-step inputs of the attention kernel, built once for every layer."""

    __slots__ = ("continued", "fresh", "k_rows", "positions", "prompts", "seqs", "skip_from",
                 "skip_tokens", "tables")

    def __init__(
        self, positions: torch.Tensor, k_rows: torch.Tensor, seqs: torch.Tensor,
        tables: torch.Tensor, fresh: Sequence[FreshPrompts] = (),
        continued: Sequence[ContinuedPrompt] = (), prompts: PromptChunks | None = None,
        skip_from: int = NEVER, skip_tokens: int = NEVER,
    ) -> None:
        self.positions = positions
        self.k_rows = k_rows  # (T,) layer-0 K rows (of KVH * D values) of each token's slot
        self.seqs = seqs  # (S, 3): first token in the step, token count, first position
        self.tables = tables  # (S, W) block ids, padded with 0
        self.fresh = fresh  # prompts' first chunks whose attention SDPA computes
        self.continued = continued  # and their later chunks (after cached context)
        self.prompts = prompts  # or every prompt chunk, for the AMX kernel instead
        # the native call leaves the attention of the chunks of skip_tokens tokens or more
        # that attend to skip_from positions or more to them
        self.skip_from, self.skip_tokens = skip_from, skip_tokens


class FreshPrompts:
    """The first chunks (no cached context) of ``count`` prompts of ``length`` tokens in
    one step: their token indices in the step and the layer-0 K rows of their slots."""

    __slots__ = ("count", "k_rows", "length", "tokens")

    def __init__(self, length: int, tokens: list[int], k_rows: list[int]) -> None:
        self.length, self.count = length, len(tokens) // length
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.k_rows = torch.tensor(k_rows, dtype=torch.long)


def _slots(table: Sequence[int], positions: range, block_size: int,
           block_rows: int) -> list[int]:
    """The layer-0 K rows of the slots of ``positions`` in a sequence's block table."""
    return [table[p // block_size] * block_rows + p % block_size for p in positions]


CONTINUED_ROWS = 256


class ContinuedPrompt:
    """A prompt chunk of ``length`` tokens (token indices from ``first`` in the step) after
    ``start`` positions of cached context: its queries attend to the layer-0 K rows
    ``k_rows``, every position up to its last."""

    __slots__ = ("first", "k_rows", "length", "start")

    def __init__(self, first: int, start: int, length: int, k_rows: list[int]) -> None:
        self.first, self.start, self.length = first, start, length
        self.k_rows = torch.tensor(k_rows, dtype=torch.long)


class PromptChunks:
    """Prompt chunks (first chunks and chunks after cached context) whose attention the
    AMX kernel computes (csrc/attn_prefill_amx.cpp): ``chunks`` (P, 4) holds each one's
    first token in the step, cached positions before it, token count and where its keys'
    layer-0 K rows (every position up to its last) begin in ``k_rows``."""

    __slots__ = ("chunks", "k_rows")

    def __init__(self, chunks: list[tuple[int, int, int, int]], k_rows: list[int]) -> None:
        self.chunks = torch.tensor(chunks, dtype=torch.long).view(-1, 4)
        self.k_rows = torch.tensor(k_rows, dtype=torch.long)


def prefill_amx_available(mod: Any, dtype: torch.dtype, cfg: ModelConfig) -> bool:
    """Whether prompt chunks can attend through the AMX kernel: bfloat16, head_dim 64 or
    128, and a CPU with AMX-BF16 whose tile state Linux grants (KVRELAY_PREFILL_AMX=0:
    never)."""
    if os.environ.get("KVRELAY_PREFILL_AMX") == "0":
        return False
    return (dtype is torch.bfloat16 and cfg.head_dim in (64, 128)
            and bool(mod.has_amx_prefill_attention()))


class NativeBackend:
    name = "native"

    def __init__(self, cfg: ModelConfig, rope: RotaryTable, dtype: torch.dtype) -> None:
        mod = load()
        assert mod is not None
        self._ops: Any = mod
        self.isa: str = mod.isa()
        self.cfg = cfg
        self.dtype = dtype
        self.cos, self.sin = rope.float32_tables()
        self.eps = cfg.rms_norm_eps
        self.gemm_off = small_gemm_unavailable(mod, dtype)
        self.amx_off = self.gemm_off or amx_gemm_unavailable(mod, dtype)
        self.sdpa_from = prefill_sdpa_from(dtype)
        self.sdpa_min_tokens = SDPA_MIN_TOKENS
        # where SDPA would take prompt chunks, the AMX kernel takes every one if it can
        self.prefill_amx = self.sdpa_from is not None and prefill_amx_available(mod, dtype, cfg)
        self._triangles: dict[torch.dtype, torch.Tensor] = {}

    def prompt_route(self) -> str:
        """Where prompt chunks attend (kernel_choice.record_prompt_attention): ``amx``,
        ``sdpa``, ``native-tiles``, or ``native-tiles+sdpa>=N`` (SDPA from N positions)."""
        if self.prefill_amx:
            return "amx"
        if self.sdpa_from is None:
            return "native-tiles"
        return "sdpa" if self.sdpa_from <= EVERY_PROMPT_CHUNK else (
            f"native-tiles+sdpa>={self.sdpa_from}")  # and SDPA_MIN_TOKENS tokens

    def skip_rule(self) -> tuple[int, int]:
        """The native attention call leaves the prompt chunks of [1] tokens or more that
        attend to [0] positions or more to SDPA or the AMX kernel (build_metadata routes
        the same)."""
        if self.prefill_amx or self.sdpa_from == EVERY_PROMPT_CHUNK:
            return EVERY_PROMPT_CHUNK, EVERY_PROMPT_CHUNK
        if self.sdpa_from is None:
            return NEVER, NEVER
        return self.sdpa_from, self.sdpa_min_tokens

    def small_gemm(self) -> NativeSmallGemm | None:
        if self.gemm_off is not None:
            return None
        return NativeSmallGemm(self._ops, self.dtype, amx=self.amx_off is None)

    def amx_gemm(self) -> NativeSmallGemm | None:
        """The bfloat16 GEMM on AMX tiles for every row count, or None (amx_off says
        why): beside the GGUF codes, it takes the calls above theirs."""
        return NativeSmallGemm(self._ops, self.dtype, amx=True) if self.amx_off is None else None

    def build_metadata(
        self, chunks: Sequence[ChunkSpec], positions: torch.Tensor, block_size: int
    ) -> NativeStep:
        block_rows = self.cfg.num_layers * 2 * block_size
        k_rows: list[int] = []
        seqs: list[tuple[int, int, int]] = []
        tables: list[Sequence[int]] = []
        fresh: dict[int, tuple[list[int], list[int]]] = {}  # by length: tokens, K rows
        continued: list[ContinuedPrompt] = []
        prompts: list[tuple[int, int, int, int]] = []  # for the AMX kernel
        prompt_rows: list[int] = []
        skip_from, skip_tokens = self.skip_rule()
        t = 0
        for c in chunks:
            bt = c.block_ids
            end = c.start + c.length
            rows = _slots(bt, range(c.start, end), block_size, block_rows)
            k_rows.extend(rows)
            seqs.append((t, c.length, c.start))
            tables.append(bt[: -(-end // block_size)])
            if c.length > 1 and c.length >= skip_tokens and end >= skip_from:  # as skipped
                if c.start == 0 and not self.prefill_amx:
                    toks, krs = fresh.setdefault(c.length, ([], []))
                    toks.extend(range(t, t + c.length))
                    krs.extend(rows)
                else:  # every position up to the chunk's last
                    keys = _slots(bt, range(c.start), block_size, block_rows) + rows
                    if self.prefill_amx:
                        prompts.append((t, c.start, c.length, len(prompt_rows)))
                        prompt_rows.extend(keys)
                    else:
                        continued.append(ContinuedPrompt(t, c.start, c.length, keys))
            t += c.length
        width = max(len(b) for b in tables)
        padded = [list(b) + [0] * (width - len(b)) for b in tables]
        return NativeStep(
            positions.contiguous(),
            torch.tensor(k_rows, dtype=torch.long),
            torch.tensor(seqs, dtype=torch.long).view(-1, 3),
            torch.tensor(padded, dtype=torch.long),
            [FreshPrompts(n, toks, krs) for n, (toks, krs) in fresh.items()],
            continued,
            PromptChunks(prompts, prompt_rows) if prompts else None,
            skip_from, skip_tokens,
        )

    def attention(
        self, qkv: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: StepMetadata
    ) -> torch.Tensor:
        assert isinstance(meta, NativeStep)
        cfg = self.cfg
        bs = kv_cache.shape[3]
        out: torch.Tensor = self._ops.attention(
            qkv, meta.positions, self.cos, self.sin, meta.k_rows, meta.seqs, meta.tables,
            kv_cache, layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            bs, cfg.num_layers, meta.skip_from, meta.skip_tokens,
        )
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if meta.prompts is not None:
            self._ops.prefill_attention(qkv, kv_cache, out, layer, meta.prompts.chunks,
                                        meta.prompts.k_rows, H, KVH, D, bs, cfg.num_layers)
        rows = kv_cache.view(-1, KVH * D)
        for f in meta.fresh:  # q rotated in qkv, K and V as written to the cache
            k_rows = f.k_rows + layer * 2 * bs
            shape = (f.count, f.length, -1, D)
            q = qkv.index_select(0, f.tokens)[:, : H * D].reshape(shape).transpose(1, 2)
            k, v = (rows.index_select(0, k_rows + off).to(qkv.dtype).view(shape).transpose(1, 2)
                    for off in (0, bs))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.index_copy_(0, f.tokens, o.transpose(1, 2).reshape(-1, H * D))
        for c in meta.continued:  # over the cached context and the chunk's own K and V
            k_rows = c.k_rows + layer * 2 * bs
            q = qkv[c.first : c.first + c.length, : H * D].view(1, c.length, H, D).transpose(1, 2)
            k, v = (rows.index_select(0, k_rows + off).to(qkv.dtype)
                    .view(1, -1, KVH, D).transpose(1, 2) for off in (0, bs))
            # CONTINUED_ROWS queries at a time, each over the positions up to its last
            # (the block's own keys masked past each query's): one call over all of them
            # computes the masked half too (a 1,952-token chunk after 48: 16.1 ms a
            # layer, 9.9 in blocks of 256, as is_causal), and a mask over all of them
            # would take length x context values
            for r0 in range(0, c.length, CONTINUED_ROWS):
                r1 = min(c.length, r0 + CONTINUED_ROWS)
                seen = c.start + r1
                mask = qkv.new_zeros(r1 - r0, seen)
                mask[:, c.start + r0 :] = self._later(qkv.dtype)[: r1 - r0, : r1 - r0]
                o = F.scaled_dot_product_attention(
                    q[:, :, r0:r1], k[:, :, :seen], v[:, :, :seen], attn_mask=mask,
                    enable_gqa=True)
                out[c.first + r0 : c.first + r1] = o.transpose(1, 2).reshape(r1 - r0, H * D)
        return out

    def _later(self, dtype: torch.dtype) -> torch.Tensor:
        """(CONTINUED_ROWS, CONTINUED_ROWS): -inf where a query's key comes after it."""
        tri = self._triangles.get(dtype)
        if tri is None:
            tri = torch.full((CONTINUED_ROWS, CONTINUED_ROWS), float("-inf"), dtype=dtype)
            self._triangles[dtype] = tri.triu_(1)
        return tri

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._ops.rms_norm(x, weight, self.eps)
        return out

    def add_rms_norm(
        self, h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = self._ops.add_rms_norm(h, r, weight, self.eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._ops.silu_mul(gate_up)
        return out
