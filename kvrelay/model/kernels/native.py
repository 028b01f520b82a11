"""The native CPU backend: kvrelay/model/kernels/csrc (C++, OpenMP), built ahead of time by
``make`` into ``kvrelay/model/kernels/_native*.so`` against the installed torch.

Per layer it runs three parallel regions besides the GEMMs: rope + KV write +
paged attention (K/V read in place from the block-major cache, GQA, decode rows and
prefill chunks in one call), residual add + RMSNorm, silu * mul. The pure-torch
path runs wherever this one cannot: extension missing or built for another torch
(import fails), a CPU without AVX2, a dtype other than float32/bfloat16, a device
other than the CPU, or a self-check at load that disagrees with torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvrelay import env
from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.kernels.backend import StepMetadata
from kvrelay.model.kernels.cpu import cpu_has_amx_bf16
from kvrelay.model.kernels.ext import load
from kvrelay.model.kernels.gemms import (
    GgufGemms,
    NativeSmallGemm,
    amx_gemm_unavailable,
    small_gemm_unavailable,
)
from kvrelay.model.kernels.rope import RotaryTable

if TYPE_CHECKING:
    from kvrelay.model.formats.gguf_loader import QuantWeight


# Where prompt chunks leave the native tiles for torch's SDPA: a chunk that attends to at
# least this many positions (its cached context and its own tokens), by the model's
# dtype, and has at least SDPA_MIN_TOKENS tokens (for fewer, SDPA would gather the whole
# context's K/V for little work). The tiles' cost per query grows with the context
# faster than SDPA's, and SDPA costs more per call; the crossings were measured per dtype
# and ISA (docs/notebook/, "Prompt attention by length"). bfloat16 on a CPU with
# AMX-BF16: SDPA (on AMX itself) for every chunk, or the AMX kernel where it can.
SDPA_FROM = {torch.float32: 640, torch.bfloat16: 320}
SDPA_MIN_TOKENS = 128
EVERY_PROMPT_CHUNK = 2  # a prompt chunk has two tokens or more, so attends to 2 or more
NEVER = 1 << 62  # no chunk attends to this many positions


def prefill_sdpa_from(dtype: torch.dtype) -> int | None:
    """From how many attended positions a prompt chunk goes to torch's SDPA instead of the
    native tiles, or None for never (KVRELAY_PREFILL_SDPA=1: every prompt chunk, =0:
    none; default: SDPA_FROM by dtype, every chunk for bfloat16 on AMX-BF16)."""
    forced = env.get("KVRELAY_PREFILL_SDPA")
    if forced is not None:
        return EVERY_PROMPT_CHUNK if forced else None
    if dtype is torch.bfloat16 and cpu_has_amx_bf16():
        return EVERY_PROMPT_CHUNK
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
    if not env.get("KVRELAY_PREFILL_AMX"):
        return False
    return (dtype is torch.bfloat16 and cfg.head_dim in (64, 128)
            and bool(mod.has_amx_prefill_attention()))


class NativeBackend:
    name = "native"
    serves_quantized = True

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

    def quantized_gemms(self, quantized: Mapping[str, QuantWeight]) -> GgufGemms:
        return GgufGemms(self._ops, quantized, self.dtype, amx=self.amx_off is None)

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
