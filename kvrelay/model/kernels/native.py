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

from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.kernels.backend import StepMetadata
from kvrelay.model.kernels.ext import load
from kvrelay.model.kernels.gemms import (
    GgufGemms,
    NativeSmallGemm,
    amx_gemm_unavailable,
    small_gemm_unavailable,
)
from kvrelay.model.kernels.native_step import (
    CONTINUED_ROWS,
    ContinuedPrompt,
    FreshPrompts,
    NativeStep,
    PromptChunks,
    _slots,
)
from kvrelay.model.kernels.prompt_route import (
    EVERY_PROMPT_CHUNK,
    NEVER,
    SDPA_MIN_TOKENS,
    prefill_amx_available,
    prefill_sdpa_from,
)
from kvrelay.model.kernels.rope import RotaryTable

if TYPE_CHECKING:
    from kvrelay.model.formats.gguf_loader import QuantWeight


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
        self.sdpa_from = prefill_sdpa_from()
        self.sdpa_min_tokens = SDPA_MIN_TOKENS
        # where SDPA would take prompt chunks, the AMX kernel takes every one if it can
        self.prefill_amx = self.sdpa_from is not None and prefill_amx_available(mod, dtype, cfg)
        self._triangles: dict[torch.dtype, torch.Tensor] = {}

    def take_fp8_cache(self) -> None:
        """An fp8 cache (uint8 codes and scales): every prompt chunk attends on the native
        tiles, which dequantize per chunk of 16 rows; SDPA and the AMX kernel take float
        rows."""
        self.sdpa_from = None
        self.prefill_amx = False
        kernel_choice.record_prompt_attention(self.prompt_route())

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

    def quantized_gemms(self, quantized: Mapping[str, QuantWeight]) -> GgufGemms:
        return GgufGemms(self._ops, quantized)

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
