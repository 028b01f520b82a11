"""The native CPU kernels against the torch backend (the reference, itself checked
against contiguous attention and transformers), on every instruction-set path this
CPU has, over head dims, GQA ratios, block sizes, ragged contexts, chunked prefill
and batch sizes; plus the fallback to torch when the extension cannot run.

``KVRELAY_REQUIRE_NATIVE=1`` (set by ``make test``) turns a missing extension into a
failure instead of a skip, so CI cannot pass without building it.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.model.kernels import ext, gemms, native, native_step, prompt_route
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.kernels.backend import TorchBackend
from kvrelay.model.kernels.rope import RotaryTable
from kvrelay.model.kernels.select import select_backend
from kvrelay.model.model import Linear, LlamaModel

_mod = ext.load()
if _mod is None:
    if os.environ.get("KVRELAY_REQUIRE_NATIVE") == "1":
        raise RuntimeError(f"KVRELAY_REQUIRE_NATIVE=1 but {ext.load_error()}")
    pytestmark = pytest.mark.skip(reason=f"native kernels unavailable: {ext.load_error()}")

_best = _mod.isa() if _mod is not None else "none"


def _amx_now() -> bool:
    """The AMX prompt kernel runs under the ISA the kernels run with now (not forced AVX2)."""
    return _mod is not None and bool(_mod.has_amx_prefill_attention())


@pytest.fixture(params=["per-head", "all-heads"])
def heads(request: pytest.FixtureRequest) -> Iterator[str]:
    """Decode tiles head by head, or one tile over every KV head of a sequence (what a
    long context takes: bindings.cpp, whole_heads_bytes), at every context."""
    assert _mod is not None
    _mod.set_whole_heads_bytes(0 if request.param == "all-heads" else 1 << 62)
    yield request.param
    _mod.set_whole_heads_bytes(-1)


def _cfg(heads: int, kv_heads: int, head_dim: int, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=heads * head_dim,
        intermediate_size=64, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False,
    )


def _backends(
    cfg: ModelConfig, dtype: torch.dtype
) -> tuple[TorchBackend, native.NativeBackend]:
    rope = RotaryTable(cfg, 512, dtype, torch.device("cpu"))
    return TorchBackend(cfg, rope, dtype), native.NativeBackend(cfg, rope, dtype)


def _random_step(
    rng: random.Random, batch: int, block_size: int, num_blocks: int, decode: bool = False
) -> list[ChunkSpec]:
    """A mixed step: decode rows at ragged contexts, fresh prompts, later chunks; with
    ``decode``, decode rows only (contexts of 1 to 151 positions): the step whose
    sequences the threads take in fixed shares, each fetching its next sequence's K/V
    ahead (csrc/bindings.cpp, attention)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for _ in range(batch):
        kind = 0.0 if decode else rng.random()
        if kind < 0.6:
            start, length = rng.randint(0, 150), 1  # a decode row
        elif kind < 0.8:
            start, length = 0, rng.randint(2, 40)  # a prompt's first chunk
        else:
            start, length = rng.randint(1, 100), rng.randint(2, 40)  # a later chunk
        n_blocks = -(-(start + length) // block_size)
        chunks.append(ChunkSpec(start, length, [free.pop() for _ in range(n_blocks)]))
    return chunks


def _attend_both(
    cfg: ModelConfig, dtype: torch.dtype, chunks: list[ChunkSpec], block_size: int,
    num_blocks: int, layer: int, seed: int, cache_dtype: torch.dtype | None = None,
    sdpa_from: int | None = None, prefill_amx: bool = False, min_tokens: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both backends on one step, with the same history in the cache (of dtype
    ``cache_dtype``, default ``dtype``); ``sdpa_from``: the native backend hands the
    prompt chunks of ``min_tokens`` tokens or more that attend to that many positions
    or more to SDPA
    (prompt_route.prefill_sdpa_from), or with ``prefill_amx`` every one to the AMX kernel
    (prompt_route.prefill_amx_available)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.randn(shape, generator=g).to(cache_dtype or dtype)
    T = sum(c.length for c in chunks)
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    qkv = torch.randn(T, width, generator=g).to(dtype)
    pos = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.length)])
    ref_b, nat_b = _backends(cfg, dtype)
    nat_b.prefill_amx = prefill_amx
    nat_b.sdpa_from = prompt_route.EVERY_PROMPT_CHUNK if prefill_amx else sdpa_from
    nat_b.sdpa_min_tokens = min_tokens
    cut = prompt_route.NEVER if nat_b.sdpa_from is None else nat_b.sdpa_from
    ref_cache, nat_cache = cache.clone(), cache.clone()
    ref = ref_b.attention(qkv.clone(), ref_cache, layer,
                          ref_b.build_metadata(chunks, pos, block_size))
    meta = nat_b.build_metadata(chunks, pos, block_size)
    sdpa = [] if prefill_amx else [c for c in chunks if c.length > 1 and c.length >= min_tokens
                                   and c.start + c.length >= cut]
    assert sum(f.count for f in meta.fresh) == sum(c.start == 0 for c in sdpa)
    assert len(meta.continued) == sum(c.start > 0 for c in sdpa)
    prompts = sum(c.length > 1 for c in chunks) if prefill_amx else 0
    assert (0 if meta.prompts is None else len(meta.prompts.chunks)) == prompts
    nat_qkv = qkv.clone()
    out = nat_b.attention(nat_qkv, nat_cache, layer, meta)
    _NATIVE_Q[:] = [nat_qkv]  # its q heads rotated in place, for _attend_over_cache
    return ref, out, ref_cache, nat_cache


_NATIVE_Q: list[torch.Tensor] = []


def _attend_over_cache(cfg: ModelConfig, chunks: list[ChunkSpec], qkv: torch.Tensor,
                       cache: torch.Tensor, layer: int, block_size: int) -> torch.Tensor:
    """Causal attention in float64 of every step token over the K/V the cache holds
    for its context (its own included): what the native kernels must compute over
    what they wrote."""
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out, t = [], 0
    for c in chunks:
        pos = torch.arange(c.start + c.length)
        blocks = torch.tensor(c.block_ids)[pos // block_size]
        kv = cache[blocks, layer, :, pos % block_size].double()  # (ctx, 2, KVH, D)
        k = kv[:, 0].repeat_interleave(H // KVH, dim=1)  # (ctx, H, D)
        v = kv[:, 1].repeat_interleave(H // KVH, dim=1)
        q = qkv[t : t + c.length, : H * D].double().view(c.length, H, D)
        scores = torch.einsum("thd,chd->htc", q, k) * D**-0.5
        mask = pos[None, :] > (c.start + torch.arange(c.length))[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("htc,chd->thd", probs, v).reshape(c.length, H * D))
        t += c.length
    return torch.cat(out)


# (head_dim, heads, kv_heads, block_size, batch): head dims 64/128, GQA 1/3/4/8,
# block sizes 16/32, batch 1 to 64; a lean sample of the product.
SHAPES = [
    (64, 9, 3, 16, 8),
    (64, 8, 8, 32, 1),
    (64, 32, 4, 16, 64),
    (128, 8, 1, 32, 5),
    (128, 16, 2, 16, 16),
    (128, 12, 4, 32, 3),
]


# Where prompt chunks attend in the tests below: the native tiles, SDPA, or split by the
# positions a chunk attends to (NativeBackend's rule for a sdpa_from; 24: the random
# steps' prompt chunks fall on both sides).
SDPA_FROM = {"tiles": None, "sdpa": prompt_route.EVERY_PROMPT_CHUNK, "split": 24}


@pytest.mark.parametrize("prefill", ["tiles", "sdpa", "split"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-h{}-kv{}-bs{}-b{}".format(*s))
def test_attention_float32_matches_torch(isa: str, shape: tuple[int, ...], prefill: str) -> None:
    """Native against torch on a mixed step; prompt chunks by the native tiles, by
    SDPA, or split between them by length (the default), decode rows by the tiles."""
    D, H, KVH, bs, batch = shape
    cfg = _cfg(H, KVH, D)
    rng = random.Random(hash(shape) % 1000)
    nb = batch * (-(-200 // bs)) + 1
    chunks = _random_step(rng, batch, bs, nb)
    if prefill != "tiles":  # two prompts' first chunks of one length: one batched call
        free = sorted(set(range(nb)) - {b for c in chunks for b in c.block_ids})
        n = 9 if prefill == "sdpa" else 30
        chunks += [ChunkSpec(0, n, free[i * 3 : i * 3 + -(-n // bs)]) for i in range(2)]
    ref, out, ref_cache, nat_cache = _attend_both(cfg, torch.float32, chunks, bs, nb, 1, 7,
                                                  sdpa_from=SDPA_FROM[prefill])
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    # The fused rope + KV write put the same rotated K and the same V in the same slots.
    torch.testing.assert_close(nat_cache, ref_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill", ["tiles", "sdpa", "split", "split-long", "amx"])
def test_later_prompt_chunks_match_float64(isa: str, prefill: str, dtype: torch.dtype) -> None:
    """Prompt chunks after cached context (chunked prefill, a pulled or cached prefix):
    by the native tiles, by SDPA over the context gathered from the blocks with a
    mask that keeps each query from the positions after its own, native_step.CONTINUED_ROWS
    queries a call (the 300-token chunk takes two), split between the two by the
    positions they attend to (from 200: the chunks ending at 400 and 333 by SDPA; with
    ``split-long`` only chunks of 128 tokens or more: the one ending at 333), or
    (bfloat16) by the AMX kernel.
    Against float64 attention over what the native cache holds, beside a decode row and
    a first chunk; within float32 rounding, or for bfloat16 within its rounding of the
    output."""
    if prefill == "amx" and (dtype is torch.float32 or not _amx_now()):
        pytest.skip("the AMX kernel takes bfloat16, with the AVX-512 kernels on AMX-BF16")
    cfg, bs = _cfg(9, 3, 64), 16
    spans = [(300, 100), (17, 2), (0, 40), (120, 1), (33, 300)]  # 300: two row blocks
    nb = sum(-(-(s + n) // bs) for s, n in spans) + 1
    free = list(range(nb))
    random.Random(2).shuffle(free)
    chunks = [ChunkSpec(s, n, [free.pop() for _ in range(-(-(s + n) // bs))]) for s, n in spans]
    _, out, _, nat_cache = _attend_both(cfg, dtype, chunks, bs, nb, 1, 3,
                                        sdpa_from=200 if prefill.startswith("split")
                                        else SDPA_FROM.get(prefill),
                                        prefill_amx=prefill == "amx",
                                        min_tokens=128 if prefill == "split-long" else 2)
    exact = _attend_over_cache(cfg, chunks, _NATIVE_Q[0], nat_cache, 1, bs)
    scale = exact.abs().max().item()
    if dtype is torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(out.double(), exact, rtol=1 / 64, atol=scale / 128)


needs_amx_attention = pytest.mark.skipif(not _amx_now(), reason="the CPU lacks AMX-BF16")


@needs_amx_attention
@pytest.mark.parametrize("growing", [False, True], ids=["random", "growing-keys"])
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size"),
                         [(64, 9, 3, 16), (64, 8, 8, 32), (64, 32, 4, 16), (64, 6, 1, 16),
                          (128, 8, 2, 16), (128, 4, 4, 32)])
def test_amx_prompt_attention_matches_float64(head_dim: int, heads: int, kv_heads: int,
                                              block_size: int, growing: bool) -> None:
    """The AMX kernel (csrc/attn_prefill_amx.cpp) on first chunks and chunks after cached
    context, at lengths around its 16-query units and 32-key blocks and up to 480
    positions, two threads, beside decode rows; head_dim 64 and 128 (two units of 64
    output dims per 16 queries). ``growing-keys``: K grows with position
    (and q is scaled up), so that a later block's scores pass the running max by more
    than the 2^8 the kernel lets P reach, again and again (its rescale of O). Against
    float64 attention over what the native cache holds, within bfloat16 rounding."""
    cfg, bs, layer, D = _cfg(heads, kv_heads, head_dim), block_size, 1, head_dim
    spans = [(0, 2), (0, 16), (0, 17), (0, 33), (0, 200), (1, 31), (31, 2), (32, 64),
             (100, 1), (150, 330), (7, 1)]
    nb = sum(-(-(s + n) // bs) for s, n in spans) + 1
    free = list(range(nb))
    random.Random(heads).shuffle(free)
    chunks = [ChunkSpec(s, n, [free.pop() for _ in range(-(-(s + n) // bs))]) for s, n in spans]
    g = torch.Generator().manual_seed(heads + block_size)
    shape = (nb, cfg.num_layers, 2, bs, kv_heads, D)
    cache = torch.randn(shape, generator=g)
    T = sum(c.length for c in chunks)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g)
    if growing:  # the context's keys, and the step's own (written from qkv), grow
        for c in chunks:
            for p in range(c.start):
                cache[c.block_ids[p // bs], layer, 0, p % bs] *= 1 + p / 16
        t = 0
        for c in chunks:
            grow = (1 + (c.start + torch.arange(c.length, dtype=torch.float32)) / 16)[:, None]
            qkv[t : t + c.length, heads * D : (heads + kv_heads) * D] *= grow
            qkv[t : t + c.length, : heads * D] *= 4
            t += c.length
    cache, qkv = cache.to(torch.bfloat16), qkv.to(torch.bfloat16)
    pos = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.length)])
    _, nat = _backends(cfg, torch.bfloat16)
    nat.sdpa_from, nat.prefill_amx = prompt_route.EVERY_PROMPT_CHUNK, True
    meta = nat.build_metadata(chunks, pos, bs)
    assert meta.prompts is not None and len(meta.prompts.chunks) == 9
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = nat.attention(qkv, cache, layer, meta)
    finally:
        torch.set_num_threads(threads)
    exact = _attend_over_cache(cfg, chunks, qkv, cache, layer, bs)
    scale = exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact, rtol=1 / 64, atol=scale / 128)


@needs_amx_attention
def test_amx_prompt_attention_rejects_bad_input() -> None:
    """Chunks that do not fit the step or the key rows (values near 2^63 included, whose
    sums would wrap), chunks that overlap, K rows outside the cache, a layer past the
    cache, and other dtypes or head dims are refused with an error naming them, before
    anything is written."""
    assert _mod is not None
    H, KVH, D, bs, layers = 4, 2, 64, 16, 2
    cache = torch.zeros(4, layers, 2, bs, KVH * D, dtype=torch.bfloat16)
    qkv = torch.zeros(8, (H + 2 * KVH) * D, dtype=torch.bfloat16)
    out = torch.full((8, H * D), 7.0, dtype=torch.bfloat16)  # what a refused call leaves
    rows = torch.arange(8)
    big = 2**63 - 1

    def call(chunks: list[list[int]], k_rows: torch.Tensor = rows, q: torch.Tensor = qkv,
             d: int = D, layer: int = 1) -> None:
        _mod.prefill_attention(q, cache, out, layer, torch.tensor(chunks), k_rows, H, KVH, d,
                               bs, layers)

    for bad in ([[0, 0, 9, 0]], [[0, 4, 6, 0]], [[big, 0, 1, 0]], [[0, 0, 1, big - 3]],
                [[0, big - 2, 2, 0]], [[-1, 0, 2, 0]], [[0, 0, 0, 0]]):
        with pytest.raises(RuntimeError, match="does not fit the step or k_rows"):
            call(bad)
    with pytest.raises(RuntimeError, match="chunks overlap at token 2"):
        call([[0, 0, 4, 0], [2, 0, 2, 0]])
    for k_rows in (rows + 4 * layers * 2 * bs, torch.full((8,), big - 10), rows - 1):
        with pytest.raises(RuntimeError, match="outside the cache"):
            call([[0, 0, 8, 0]], k_rows=k_rows)
    with pytest.raises(RuntimeError, match="does not fit the cache"):
        call([[0, 0, 8, 0]], layer=2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call([[0, 0, 8, 0]], q=qkv.float())
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        call([[0, 0, 8, 0]], d=32)
    assert (out == 7).all()
    call([[0, 0, 8, 0]])  # zeros in, zeros out (uniform weights over zero V)
    assert (out == 0).all()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 9, 3, 16, 8), (64, 32, 4, 16, 13), (128, 8, 1, 32, 4),
                                   (128, 16, 2, 16, 64)],
                         ids=lambda s: "d{}-h{}-kv{}-bs{}-b{}".format(*s))
def test_attention_float32_decode_steps_match_float64(
    isa: str, heads: str, shape: tuple[int, ...], cache_dtype: torch.dtype
) -> None:
    """Decode-only steps (every thread a share of whole sequences, the next one's K/V
    fetched while it computes): exact to float32 rounding against float64 attention
    over what the native cache holds, at batches that split unevenly over the threads."""
    D, H, KVH, bs, batch = shape
    cfg = _cfg(H, KVH, D)
    nb = batch * (-(-200 // bs)) + 1
    chunks = _random_step(random.Random(batch), batch, bs, nb, decode=True)
    _, out, _, nat_cache = _attend_both(cfg, torch.float32, chunks, bs, nb, 1, 9,
                                        cache_dtype=cache_dtype)
    exact = _attend_over_cache(cfg, chunks, _NATIVE_Q[0], nat_cache, 1, bs)
    scale = exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("contexts", [[50] * 7 + [400], [400] + [50] * 7, [1, 1, 1, 400]],
                         ids=["long-last", "long-first", "tiny-then-long"])
def test_attention_decode_steps_with_skewed_contexts_match_float64(
    isa: str, heads: str, contexts: list[int]
) -> None:
    """Decode steps whose contexts skew the threads' shares (one long sequence among
    short ones, first or last), on two threads: every tile computed once, exact to
    float32 rounding against float64."""
    cfg, bs = _cfg(9, 3, 64), 16
    nb = sum(-(-c // bs) for c in contexts) + 1
    free = list(range(nb))
    random.Random(7).shuffle(free)
    chunks = [ChunkSpec(c - 1, 1, [free.pop() for _ in range(-(-c // bs))]) for c in contexts]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, out, _, nat_cache = _attend_both(cfg, torch.float32, chunks, bs, nb, 1, 5)
    finally:
        torch.set_num_threads(threads)
    exact = _attend_over_cache(cfg, chunks, _NATIVE_Q[0], nat_cache, 1, bs)
    scale = exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-h{}-kv{}-bs{}-b{}".format(*s))
@pytest.mark.parametrize("prefill", ["tiles", "sdpa"])
@pytest.mark.parametrize("seed", [1, 4])
def test_attention_float32_over_a_bfloat16_cache_matches_torch(
    isa: str, shape: tuple[int, ...], seed: int, prefill: str
) -> None:
    """--kv-cache-dtype bfloat16 under float32: the native kernels write the rotated K
    and V rounded to bfloat16 and attend over them in float32, prefill and decode tiles
    (or SDPA) alike. Exact to float32 rounding against float64 attention over what the
    native cache holds; against the torch path within the bfloat16 rounding of K,
    since the two float32 rotations may differ in the last bit, which a rounding to
    bfloat16 can carry to the next bfloat16 value."""
    D, H, KVH, bs, batch = shape
    cfg = _cfg(H, KVH, D)
    rng = random.Random(hash(shape) % 1000 + seed)
    nb = batch * (-(-200 // bs)) + 1
    chunks = _random_step(rng, batch, bs, nb)
    if prefill == "sdpa":
        free = sorted(set(range(nb)) - {b for c in chunks for b in c.block_ids})
        chunks.append(ChunkSpec(0, 7, free[: -(-7 // bs)]))
    ref, out, ref_cache, nat_cache = _attend_both(cfg, torch.float32, chunks, bs, nb, 1,
                                                  seed, cache_dtype=torch.bfloat16,
                                                  sdpa_from=SDPA_FROM[prefill])
    assert nat_cache.dtype is torch.bfloat16 and out.dtype is torch.float32
    exact = _attend_over_cache(cfg, chunks, _NATIVE_Q[0], nat_cache, 1, bs)
    scale = exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-7 * scale)
    torch.testing.assert_close(nat_cache.float(), ref_cache.float(), rtol=2**-7, atol=1e-6)


# (head_dim, heads, kv_heads, block_size): the AVX-512 BF16 kernels (attn_bf16.cpp)
# take head dims 64 and 128 and blocks of 16 or 32, GQA 1 to 32 (partial groups of
# query rows with G = 3 at both head dims, 2-token prefill tiles at G = 32); head dim
# 80 and blocks of 8 fall back to the generic tile kernel.
BF16_SHAPES = [(64, 9, 3, 16), (128, 16, 2, 32), (128, 32, 4, 16), (64, 8, 8, 32),
               (128, 6, 2, 16), (64, 32, 1, 16), (80, 4, 2, 16), (64, 6, 2, 8)]


@pytest.mark.parametrize("prefill", ["tiles", "sdpa", "amx"])
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=lambda s: "d{}-h{}-kv{}-bs{}".format(*s))
def test_attention_bfloat16_no_worse_than_torch(isa: str, shape: tuple[int, ...],
                                                prefill: str) -> None:
    """bfloat16: against a float32 reference on the same (bf16-representable) inputs,
    the native error (mean and max over outputs) is no larger than the torch path's,
    within one bfloat16 rounding of the output for the max; prompt chunks by the
    native tiles, by SDPA or (head_dim 64, 128) by the AMX kernel."""
    D, H, KVH, bs = shape
    if prefill == "amx" and (D not in (64, 128) or not _amx_now()):
        pytest.skip("the AMX kernel takes head_dim 64 or 128, with the AVX-512 kernels on "
                    "AMX-BF16")
    cfg = _cfg(H, KVH, D)
    nb = 24 * (-(-200 // bs)) + 1
    chunks = _random_step(random.Random(3), 24, bs, nb)
    g = torch.Generator().manual_seed(11)
    shape = (nb, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.randn(shape, generator=g).to(torch.bfloat16)
    width = (H + 2 * KVH) * D
    qkv = torch.randn(sum(c.length for c in chunks), width, generator=g).to(torch.bfloat16)
    pos = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.length)])
    ref_b = TorchBackend(cfg, RotaryTable(cfg, 512, torch.float32, torch.device("cpu")),
                         torch.float32)
    ref = ref_b.attention(qkv.float(), cache.float(), 0, ref_b.build_metadata(chunks, pos, bs))
    errs = []
    for b in _backends(cfg, torch.bfloat16):
        if isinstance(b, native.NativeBackend):
            b.prefill_amx = prefill == "amx"
            b.sdpa_from = None if prefill == "tiles" else prompt_route.EVERY_PROMPT_CHUNK
        meta = b.build_metadata(chunks, pos, bs)
        if isinstance(meta, native_step.NativeStep):
            assert bool(meta.fresh) == (prefill == "sdpa")
            assert (meta.prompts is not None) == (prefill == "amx")
        out = b.attention(qkv.clone(), cache.clone(), 0, meta)
        errs.append((out.float() - ref).abs())
    t_err, n_err = errs
    assert n_err.mean() <= t_err.mean(), (n_err.mean(), t_err.mean())
    assert n_err.max() <= t_err.max() + ref.abs().max() / 128


@pytest.mark.skipif(_mod is None or not _mod.has_bf16_gemm(),
                    reason="the CPU lacks AVX-512 BF16")
@pytest.mark.parametrize("step", ["mixed", "decode"])
@pytest.mark.parametrize("shape", BF16_SHAPES[:6], ids=lambda s: "d{}-h{}-kv{}-bs{}".format(*s))
def test_attention_bf16_kernels_match_the_generic_kernel(shape: tuple[int, ...],
                                                         step: str, heads: str) -> None:
    """The AVX-512 BF16 decode and prefill kernels against the generic tile kernel (the
    AVX2 path) on the same step: both keep scores and probabilities in float32, so they
    differ by summation order and the final rounding to bfloat16 only. A mask or row
    mapping error (one key too many at context ~100 moves an output by about 1/100 of
    a V row) is far outside this bound."""
    assert _mod is not None
    D, H, KVH, bs = shape
    cfg = _cfg(H, KVH, D)
    nb = 24 * (-(-200 // bs)) + 1
    chunks = _random_step(random.Random(5), 24, bs, nb, decode=step == "decode")
    g = torch.Generator().manual_seed(13)
    cache = torch.randn((nb, cfg.num_layers, 2, bs, KVH, D), generator=g).to(torch.bfloat16)
    width = (H + 2 * KVH) * D
    qkv = torch.randn(sum(c.length for c in chunks), width, generator=g).to(torch.bfloat16)
    pos = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.length)])
    _, nat = _backends(cfg, torch.bfloat16)
    nat.sdpa_from, nat.prefill_amx = None, False  # the prompt chunks by the tiles too
    outs = []
    for isa in ("avx512", "avx2"):
        assert _mod.set_isa(isa)
        try:
            outs.append(nat.attention(qkv.clone(), cache.clone(), 1,
                                      nat.build_metadata(chunks, pos, bs)).float())
        finally:
            _mod.set_isa(_best)
    fast, generic = outs
    torch.testing.assert_close(fast, generic, rtol=1 / 128, atol=generic.abs().max().item() / 256)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("shape", [(64, 9, 3, 16), (128, 16, 2, 32), (64, 8, 8, 16),
                                   (128, 8, 1, 16)],
                         ids=lambda s: "d{}-h{}-kv{}-bs{}".format(*s))
def test_decode_tiles_over_every_head_equal_the_tiles_head_by_head(
    isa: str, shape: tuple[int, ...], dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """A long context's decode tile over every KV head (each chunk's K/V rows taken by
    all heads while in L1) computes each head's scores, softmax and sums in the same
    operations and order as the tiles head by head: the same output, bit for bit, on
    every kernel (AVX-512 BF16, and the generic one under both ISAs), at contexts from
    1 to past a block boundary, on two threads (shares, Fetch)."""
    assert _mod is not None
    D, H, KVH, bs = shape
    cfg = _cfg(H, KVH, D)
    contexts = [1, 17, 300, 45, 128, 33, 480, 5]
    nb = sum(-(-c // bs) for c in contexts) + 1
    free = list(range(nb))
    random.Random(3).shuffle(free)
    chunks = [ChunkSpec(c - 1, 1, [free.pop() for _ in range(-(-c // bs))]) for c in contexts]
    g = torch.Generator().manual_seed(11)
    cache = torch.randn((nb, cfg.num_layers, 2, bs, KVH, D), generator=g).to(cache_dtype)
    qkv = torch.randn(len(chunks), (H + 2 * KVH) * D, generator=g).to(dtype)
    pos = torch.tensor([c.start for c in chunks])
    _, nat = _backends(cfg, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    outs = []
    try:
        for whole in (1 << 62, 0):
            _mod.set_whole_heads_bytes(whole)
            outs.append(nat.attention(qkv.clone(), cache.clone(), 1,
                                      nat.build_metadata(chunks, pos, bs)))
    finally:
        _mod.set_whole_heads_bytes(-1)
        torch.set_num_threads(threads)
    head_by_head, every_head = outs
    assert torch.equal(every_head, head_by_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_match_torch(isa: str, dtype: torch.dtype) -> None:
    cfg = _cfg(9, 3, 64)
    t_b, n_b = _backends(cfg, dtype)
    g = torch.Generator().manual_seed(5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype is torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for rows in (1, 7, 130):  # one thread, and a parallel region (>= 64K elements)
        h = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
        r = torch.randn(rows, 576, generator=g).to(dtype)
        w = torch.rand(576, generator=g).to(dtype)
        torch.testing.assert_close(n_b.rms_norm(h, w), t_b.rms_norm(h, w), **tol)
        h_t, h_n = h.clone(), h.clone()
        out_t, out_n = t_b.add_rms_norm(h_t, r, w), n_b.add_rms_norm(h_n, r, w)
        assert torch.equal(h_n, h_t)  # the residual add rounds exactly like torch's
        torch.testing.assert_close(out_n, out_t, **tol)
        gu = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
        torch.testing.assert_close(n_b.silu_mul(gu), t_b.silu_mul(gu), **tol)


def test_native_rejects_bad_input() -> None:
    assert _mod is not None
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _mod.rms_norm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16),
                      1e-5)
    with pytest.raises(RuntimeError, match="weight must match"):
        _mod.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    assert not _mod.set_isa("avx9000")


def test_select_backend_follows_request_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(4, 2, 16)
    rope = RotaryTable(cfg, 64, torch.float32, torch.device("cpu"))
    cpu = torch.device("cpu")
    monkeypatch.setenv("KVRELAY_KERNELS", "torch")
    assert select_backend(cfg, rope, torch.float32, cpu).name == "torch"
    assert kernel_choice.info()["backend"] == "torch"
    assert kernel_choice.info()["prompt_attention"] == "torch"
    monkeypatch.delenv("KVRELAY_KERNELS")
    assert select_backend(cfg, rope, torch.float32, cpu).name == "native"
    blank = {"omp_wait_policy": "", "omp_spincount": "", "gemm": "", "prefill_gemm": "",
             "prompt_attention": ""}
    assert kernel_choice.info() | blank == {"backend": "native", "isa": _best} | blank
    # where prompt chunks attend, named for the log and /metrics: on the tiles by
    # default, every dtype and CPU alike (one answer per request); with
    # KVRELAY_PREFILL_SDPA=1 on SDPA, or for bfloat16 at head_dim 64 on the AMX kernel
    # where the CPU has AMX-BF16
    monkeypatch.delenv("KVRELAY_PREFILL_SDPA", raising=False)
    monkeypatch.delenv("KVRELAY_PREFILL_AMX", raising=False)
    assert select_backend(cfg, rope, torch.float32, cpu).name == "native"
    assert kernel_choice.info()["prompt_attention"] == "native-tiles"
    cfg64 = _cfg(4, 2, 64)
    rope64 = RotaryTable(cfg64, 64, torch.bfloat16, cpu)
    assert select_backend(cfg64, rope64, torch.bfloat16, cpu).name == "native"
    assert kernel_choice.info()["prompt_attention"] == "native-tiles"
    monkeypatch.setenv("KVRELAY_PREFILL_SDPA", "1")  # every prompt chunk to SDPA
    select_backend(cfg64, rope64, torch.bfloat16, cpu)
    assert kernel_choice.info()["prompt_attention"] == ("amx" if _amx_now() else "sdpa")
    monkeypatch.setenv("KVRELAY_PREFILL_AMX", "0")
    select_backend(cfg64, rope64, torch.bfloat16, cpu)
    assert kernel_choice.info()["prompt_attention"] == "sdpa"
    select_backend(cfg, rope, torch.float32, cpu)
    assert kernel_choice.info()["prompt_attention"] == "sdpa"
    monkeypatch.setenv("KVRELAY_PREFILL_SDPA", "0")
    select_backend(cfg64, rope64, torch.bfloat16, cpu)
    assert kernel_choice.info()["prompt_attention"] == "native-tiles"
    monkeypatch.delenv("KVRELAY_PREFILL_AMX")
    select_backend(cfg64, rope64, torch.bfloat16, cpu)  # =0 keeps the AMX kernel off too
    assert kernel_choice.info()["prompt_attention"] == "native-tiles"
    # float16 and head dims that are not multiples of 16 fall back, never fail.
    assert select_backend(cfg, rope, torch.float16, cpu).name == "torch"
    assert select_backend(_cfg(4, 2, 8), rope, torch.float32, cpu, "native").name == "torch"
    with pytest.raises(ValueError, match="auto, native, torch"):
        select_backend(cfg, rope, torch.float32, cpu, "fast")


def test_fallback_when_extension_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_load_error", "extension not loadable (test)")
    cfg = _cfg(4, 2, 16)
    rope = RotaryTable(cfg, 64, torch.float32, torch.device("cpu"))
    b = select_backend(cfg, rope, torch.float32, torch.device("cpu"), "native")
    assert b.name == "torch"
    assert kernel_choice.info()["backend"] == "torch"


def test_attention_refuses_block_ids_outside_the_cache() -> None:
    cfg = _cfg(4, 2, 16)
    _, nat = _backends(cfg, torch.float32)
    cache = torch.zeros(4, cfg.num_layers, 2, 4, 2, 16)
    qkv = torch.randn(2, 8 * 16)
    pos = torch.tensor([0, 1])
    meta = nat.build_metadata([ChunkSpec(0, 2, [9])], pos, 4)
    with pytest.raises(RuntimeError, match="outside the cache"):
        nat.attention(qkv, cache, 0, meta)
    assert cache.abs().sum() == 0  # nothing written
    # values near 2^63, whose sums with the layer's offset would wrap: refused too
    meta = nat.build_metadata([ChunkSpec(0, 2, [1])], pos, 4)
    meta.k_rows = torch.tensor([2**63 - 3, 0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        nat.attention(qkv, cache, 0, meta)
    meta = nat.build_metadata([ChunkSpec(0, 2, [1])], pos, 4)
    meta.seqs = torch.tensor([[0, 2**63 - 1, 0]])
    with pytest.raises(RuntimeError, match="does not fit the step"):
        nat.attention(qkv, cache, 0, meta)
    assert cache.abs().sum() == 0
    # a cache wider than the activations (float32 under bfloat16) is refused
    _, nat16 = _backends(cfg, torch.bfloat16)
    meta = nat16.build_metadata([ChunkSpec(0, 2, [1])], pos, 4)
    with pytest.raises(RuntimeError, match="bfloat16 under float32"):
        nat16.attention(qkv.bfloat16(), cache, 0, meta)
    assert cache.abs().sum() == 0


def _tiny_model(dtype: torch.dtype, kernels: str | None = None) -> LlamaModel:
    """A 2-layer model on random weights, built through LlamaModel."""
    cfg = _cfg(4, 2, 16)
    g = torch.Generator().manual_seed(0)
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (32, h),
              "model.norm.weight": (h,)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    state = {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    cpu = torch.device("cpu")
    return LlamaModel(cfg, state, dtype=dtype, device=cpu, max_len=64, kernels=kernels)


_bf16_gemm = _mod is not None and _mod.has_bf16_gemm()
needs_bf16_gemm = pytest.mark.skipif(not _bf16_gemm, reason="the CPU lacks AVX-512 BF16")


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 21, 64, 130])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (40, 96), (832, 576), (576, 1536)])
def test_bf16_gemm_no_worse_than_torch(rows: int, n: int, k: int) -> None:
    """The small-M GEMM against a float32 reference: within bfloat16 rounding, and
    on average no further from it than torch's bfloat16 GEMM (N not a multiple of 16
    and more rows than one tile included)."""
    assert _mod is not None
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    _check_bf16_gemm(_mod.bf16_gemm, x, w, torch.randn(n, generator=g).bfloat16())


def _check_bf16_gemm(
    gemm: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor
) -> None:
    """gemm(x, packed w, N, bias) within bfloat16 rounding of a float32 reference and on
    average no further from it than torch's bfloat16 GEMM, with and without the bias."""
    assert _mod is not None
    packed, (n, k) = _mod.pack_bf16_gemm(w), w.shape
    for b in (None, bias):
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        out = gemm(x, packed, n, b)
        theirs = torch.nn.functional.linear(x, w, b)
        assert out.dtype is torch.bfloat16 and out.shape == (x.shape[0], n)
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * k**0.5)
        err, torch_err = (out.float() - ref).abs().mean(), (theirs.float() - ref).abs().mean()
        assert err <= torch_err * 1.05 + 1e-6


_amx = _mod is not None and _mod.has_amx_bf16_gemm()
needs_amx = pytest.mark.skipif(not _amx, reason="the CPU lacks AMX-BF16")


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 130, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 96), (960, 576), (576, 1536)])
def test_amx_bf16_gemm_no_worse_than_torch(rows: int, n: int, k: int) -> None:
    """The AMX GEMM against a float32 reference, as the small-M one: within bfloat16
    rounding and on average no further from it than torch's bfloat16 GEMM. Rows cover
    one and two partial tiles, whole 32-row groups and a tail; N a column block not
    filled and an odd number of blocks; strided x (a view of wider rows)."""
    assert _mod is not None
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    wide = torch.randn(rows, k + 32, generator=g).bfloat16()
    x = wide[:, 16 : 16 + k]  # rows k + 32 apart
    _check_bf16_gemm(_mod.bf16_gemm_amx, x, w, torch.randn(n, generator=g).bfloat16())


@needs_amx
@pytest.mark.parametrize("rows", [1, 16, 17, 33, 100, 300])
@pytest.mark.parametrize(("i", "k"), [(16, 32), (48, 96), (1536, 576)])
def test_amx_gate_up_silu_equals_the_unfused_path(rows: int, i: int, k: int) -> None:
    """silu=True (silu(gate) * up in the tiles' epilogue) gives exactly the values of
    silu_mul over the same GEMM's (rows, 2I) output, with and without a bias: the
    same roundings in the same order. One gate block per thread and an odd count
    included."""
    assert _mod is not None
    g = torch.Generator().manual_seed(rows * 100 + i + k)
    w = torch.randn(2 * i, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = _mod.pack_bf16_gemm(w)
    for b in (None, torch.randn(2 * i, generator=g).bfloat16()):
        unfused = _mod.silu_mul(_mod.bf16_gemm_amx(x, packed, 2 * i, b))
        fused = _mod.bf16_gemm_amx(x, packed, 2 * i, b, True)
        assert fused.shape == (rows, i) and torch.equal(fused, unfused)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _mod.bf16_gemm_amx(x, _mod.pack_bf16_gemm(w[:48].contiguous()), 48, None, True)


@needs_amx
def test_model_runs_every_bf16_gemm_natively_on_amx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an AMX CPU a bfloat16 model's GEMMs are all native: one row on vdpbf16ps,
    from AMX_GEMM_ROWS rows on AMX tiles (the same results as calling the kernels
    directly), with no oneDNN copy of the weights. Beside a GGUF's codes, the calls
    above theirs go to AMX over the float weight. KVRELAY_AMX_GEMM=0 gives oneDNN
    back its calls."""
    from kvrelay.model.llm import LLM
    from kvrelay.testing.models import write_tiny_gguf

    assert _mod is not None
    m = _tiny_model(torch.bfloat16)
    assert kernel_choice.info()["gemm"] == kernel_choice.info()["prefill_gemm"] == (
        "native-bf16-amx")
    for lin in (m.layers[0].qkv, m.layers[0].gate_up, m.layers[1].down, m.lm_head):
        assert lin.packed is None and lin.small_rows >= gemms.EVERY_ROWS
        packed, n = _mod.pack_bf16_gemm(lin.weight), lin.weight.shape[0]
        one = torch.randn(1, lin.weight.shape[1]).bfloat16()
        assert torch.equal(lin(one), _mod.bf16_gemm(one, packed, n))
        for rows in (gemms.AMX_GEMM_ROWS, 40, 300):
            x = torch.randn(rows, lin.weight.shape[1]).bfloat16()
            assert torch.equal(lin(x), _mod.bf16_gemm_amx(x, packed, n))
    # the MLP's silu * up: fused on AMX and on vdpbf16ps below it; the same values
    gate_up = m.layers[0].gate_up
    for rows in (1, gemms.AMX_GEMM_ROWS, 300):
        x = torch.randn(rows, gate_up.weight.shape[1]).bfloat16()
        calls: list[int] = []

        def unfused(y: torch.Tensor, calls: list[int] = calls) -> torch.Tensor:
            calls.append(y.shape[0])
            out: torch.Tensor = _mod.silu_mul(y)
            return out

        assert torch.equal(gate_up.silu_mul(x, unfused), _mod.silu_mul(gate_up(x)))
        assert calls == []

    # K not a multiple of 32: the tiles cannot take it; vdpbf16ps up to its own limit,
    # oneDNN above, as without AMX
    odd = Linear(torch.randn(64, 48).bfloat16(), None, True,
                 gemms.NativeSmallGemm(_mod, torch.bfloat16, amx=True))
    assert odd.small_rows == gemms.BF16_GEMM_ROWS and odd.packed is not None
    x = torch.randn(gemms.BF16_GEMM_ROWS + 1, 48).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, odd.packed, None, "none", [], "")
    assert torch.equal(odd(x), onednn)

    # a GGUF's codes take every call themselves, AMX none (one answer per request)
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", seed=4))
    model = LLM(path, dtype="bfloat16").model.runner.model  # type: ignore[attr-defined]
    assert kernel_choice.info()["prefill_gemm"] == f"native-gguf-{_mod.gguf_isa()}"
    down = model.layers[0].down
    assert isinstance(down.small.__self__, gemms.NativeGgufGemm)
    assert down.small_rows >= gemms.GGUF_GEMM_ROWS_EVERY and down.packed is None

    monkeypatch.setenv("KVRELAY_AMX_GEMM", "0")
    m = _tiny_model(torch.bfloat16)
    assert kernel_choice.info()["gemm"] == "native-bf16"
    assert kernel_choice.info()["prefill_gemm"] == "onednn"
    assert m.layers[0].down.packed is not None


@needs_bf16_gemm
@pytest.mark.parametrize(("kernel", "odd_k", "why"), [
    ("bf16_gemm", 63, "even K"),
    pytest.param("bf16_gemm_amx", 48, "multiple of 32", marks=needs_amx),
])
def test_bf16_gemm_rejects_bad_input(kernel: str, odd_k: int, why: str) -> None:
    assert _mod is not None
    gemm = getattr(_mod, kernel)
    w = torch.randn(32, 64).bfloat16()
    packed = _mod.pack_bf16_gemm(w)
    with pytest.raises(RuntimeError, match="does not match"):
        gemm(torch.randn(2, 64).bfloat16(), packed, 48)
    with pytest.raises(RuntimeError, match=why):
        odd = _mod.pack_bf16_gemm(w[:, :odd_k].contiguous())
        gemm(torch.randn(2, odd_k).bfloat16(), odd, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemm(torch.randn(2, 64), packed, 32)
    with pytest.raises(RuntimeError, match="bias"):
        gemm(torch.randn(2, 64).bfloat16(), packed, 32, torch.ones(3).bfloat16())
    assert gemm(torch.empty(0, 64).bfloat16(), packed, 32).shape == (0, 32)


@needs_bf16_gemm
def test_model_uses_the_small_gemm_only_where_it_may(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on the native backend without AMX (KVRELAY_AMX_GEMM=0 on an AMX CPU):
    decode-sized calls go to the native GEMM (same result as calling it directly),
    larger ones to oneDNN; the torch backend and KVRELAY_NATIVE_GEMM=0 keep oneDNN
    (float32: test_float32_model_uses_...; AMX: test_model_runs_every_bf16_gemm_...)."""

    def build(dtype: torch.dtype, kernels: str | None = None) -> LlamaModel:
        return _tiny_model(dtype, kernels)

    monkeypatch.setenv("KVRELAY_AMX_GEMM", "0")
    m = build(torch.bfloat16)
    assert m.small_gemm and kernel_choice.info()["gemm"] == "native-bf16"
    lin = m.layers[0].gate_up
    x = torch.randn(gemms.BF16_GEMM_ROWS, lin.weight.shape[1]).bfloat16()
    assert _mod is not None
    direct = _mod.bf16_gemm(x, _mod.pack_bf16_gemm(lin.weight), lin.weight.shape[0])
    assert torch.equal(lin(x), direct)
    big = torch.randn(gemms.BF16_GEMM_ROWS + 1, lin.weight.shape[1]).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(big, lin.packed, None, "none", [], "")
    assert torch.equal(lin(big), onednn)
    assert not build(torch.bfloat16, "torch").small_gemm
    assert kernel_choice.info()["gemm"] == "onednn"
    monkeypatch.setenv("KVRELAY_NATIVE_GEMM", "0")
    assert not build(torch.bfloat16).small_gemm


@needs_bf16_gemm
def test_a_bfloat16_prefill_chunk_that_samples_nothing(tmp_path: Path) -> None:
    """Bug (review): a prefill chunk that samples nothing (a prompt longer than the token
    budget) gave lm_head zero rows, which went to the native GEMM and killed the process
    with SIGSEGV. Zero rows now go to oneDNN, and the kernel itself answers an empty
    result."""
    from kvrelay.config import SchedulerConfig
    from kvrelay.core.engine import Engine
    from kvrelay.model import load_model
    from kvrelay.sampling_params import SamplingParams
    from kvrelay.testing.models import write_tiny_hf_model

    assert _mod is not None
    packed = _mod.pack_bf16_gemm(torch.randn(32, 64).bfloat16())
    assert _mod.bf16_gemm(torch.empty(0, 64).bfloat16(), packed, 32).shape == (0, 32)
    model = load_model(str(write_tiny_hf_model(tmp_path / "llama", seed=2)), dtype="bfloat16",
                       block_size=4, num_blocks=64)
    assert model.runner.model.small_gemm  # type: ignore[attr-defined]
    outputs = []
    for budget in (64, 8):  # the whole prompt in one step, then in chunks of 8
        engine = Engine(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=512,
                                        max_num_batched_tokens=budget), model.runner)
        engine.add_request("x", [5 + i % 300 for i in range(20)],
                           SamplingParams(temperature=0.0, max_tokens=3))
        tokens: list[int] = []
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
        outputs.append(tokens)
    assert len(outputs[0]) == 3 and outputs[1] == outputs[0]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 16, 17, 21, 32, 33])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (40, 95), (832, 576), (576, 1536), (7, 3)])
def test_f32_gemm_matches_torch(isa: str, rows: int, n: int, k: int) -> None:
    """The float32 small-M GEMM on each ISA path against torch's float32 GEMM: within
    the float32 tolerance the native layer kernels are held to, and on average within
    2.5x torch's distance from a float64 reference (both at float32 rounding: torch's
    one-row GEMV keeps more partial sums at K = 64), over odd K, N not a multiple of
    16, two passes of a tile (7-12 rows under AVX2) and more rows than one tile (16
    under AVX-512, 12 under AVX2)."""
    assert _mod is not None and _mod.has_f32_gemm()
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows + 3, k, generator=g)[1 : rows + 1]  # rows apart by a stride
    bias = torch.randn(n, generator=g)
    packed = _mod.pack_f32_gemm(w)
    assert packed.shape == (-(-n // 16), k, 16)
    for b in (None, bias):
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        theirs = torch.nn.functional.linear(x, w, b)
        out = _mod.f32_gemm(x, packed, n, b)
        assert out.dtype is torch.float32 and out.shape == (rows, n)
        torch.testing.assert_close(out, theirs, rtol=1e-5, atol=1e-5 * k**0.5)
        err, torch_err = (out - ref).abs().mean(), (theirs - ref).abs().mean()
        assert err <= torch_err * 2.5 + 1e-7


def test_f32_gemm_rejects_bad_input() -> None:
    assert _mod is not None
    w = torch.randn(32, 64)
    packed = _mod.pack_f32_gemm(w)
    with pytest.raises(RuntimeError, match="does not match"):
        _mod.f32_gemm(torch.randn(2, 64), packed, 48)
    with pytest.raises(RuntimeError, match="does not match"):
        _mod.f32_gemm(torch.randn(2, 63), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        _mod.f32_gemm(torch.randn(2, 64).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        _mod.pack_f32_gemm(w.bfloat16())
    with pytest.raises(RuntimeError, match="bias"):
        _mod.f32_gemm(torch.randn(2, 64), packed, 32, torch.ones(3))
    assert _mod.f32_gemm(torch.empty(0, 64), packed, 32).shape == (0, 32)


def test_float32_model_uses_the_native_gemm_of_its_isa(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """float32 on the native backend: decode-sized calls go to the float32 GEMM of the
    ISA the kernels run with (the ``gemm`` label names it), larger ones to oneDNN; with
    the AVX2 path forced by KVRELAY_NATIVE_ISA=avx2 (in a fresh process, where the
    choice is made) a model's greedy tokens equal those of oneDNN's GEMMs."""
    import subprocess
    import sys

    from kvrelay.testing.models import write_tiny_hf_model

    m = _tiny_model(torch.float32)
    assert m.small_gemm and kernel_choice.info()["gemm"] == f"native-f32-{_best}"
    lin = m.layers[0].gate_up
    rows = gemms.F32_GEMM_ROWS
    x = torch.randn(rows, lin.weight.shape[1])
    assert _mod is not None
    direct = _mod.f32_gemm(x, _mod.pack_f32_gemm(lin.weight), lin.weight.shape[0])
    assert torch.equal(lin(x), direct)
    big = torch.randn(rows + 1, lin.weight.shape[1])
    onednn = torch.ops.mkldnn._linear_pointwise(big, lin.packed, None, "none", [], "")
    assert torch.equal(lin(big), onednn)
    monkeypatch.setenv("KVRELAY_NATIVE_GEMM", "0")
    assert not _tiny_model(torch.float32).small_gemm
    assert kernel_choice.info()["gemm"] == "onednn"

    path = write_tiny_hf_model(tmp_path / "llama", seed=3)
    script = (
        "import json; from kvrelay.model.kernels import choice as kernel_choice;"
        "from kvrelay.model.llm import LLM;"
        "from kvrelay.sampling_params import SamplingParams;"
        f"llm = LLM({str(path)!r}, dtype='float32');"
        "outs = llm.generate([[5, 6, 7], [9] * 20, list(range(40, 80))],"
        " SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True));"
        "print(json.dumps([kernel_choice.info()['gemm'], [o.outputs[0].token_ids for o in outs]]))"
    )
    results = []
    for env in ({"KVRELAY_NATIVE_ISA": "avx2"}, {"KVRELAY_NATIVE_GEMM": "0"}):
        run_env = {**os.environ, "KVRELAY_NATIVE_GEMM": "1", **env}
        out = subprocess.run([sys.executable, "-c", script], env=run_env, check=True,
                             capture_output=True, text=True).stdout
        results.append(json.loads(out.splitlines()[-1]))
    assert results[0][0] == "native-f32-avx2" and results[1][0] == "onednn"
    assert results[0][1] == results[1][1]


def _q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row's 32-value groups quantized as the kernel does (llama.cpp's Q8_0
    of activations: d = max |x| / 127, codes round(x * 127 / max |x|), half to even),
    dequantized again."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).view(x.shape)


def _gguf_quantize(w: torch.Tensor, qtype: int) -> np.ndarray:
    """w's rows as GGUF blocks of qtype (gguf_writer.quantize_as)."""
    from gguf import GGMLQuantizationType

    from kvrelay.testing.gguf_writer import quantize_as

    return quantize_as(w.numpy(), GGMLQuantizationType(qtype))


@pytest.mark.parametrize(("qtype", "n", "k"), [
    *[(q, n, k) for q in (8, 3, 7) for n, k in [(16, 64), (40, 96), (832, 576), (576, 1536)]],
    *[(q, n, k) for q in (12, 14) for n, k in [(16, 256), (40, 512), (576, 1536)]],
], ids=lambda v: {8: "Q8_0", 3: "Q4_1", 7: "Q5_1", 12: "Q4_K", 14: "Q6_K"}.get(v, str(v)))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 32])
def test_gguf_gemm_matches_the_dequantized_weight(isa: str, qtype: int, rows: int, n: int,
                                                   k: int) -> None:
    """The quantized GEMM on each ISA path (AVX-512 VNNI, AVX2) against x8 @ W^T in
    float64, W dequantized by the gguf package (what --quantization none serves) and x8
    the activations quantized to 8 bits per 32 values as the kernel does: within float32
    rounding of the same sums (float32 and bfloat16 x). Against the unquantized x the
    mean relative error is the 8-bit activations' (under 1%). Q4_K's sub-blocks carry
    float32 scales and mins (d sc, -dmin m), Q6_K's halves float32 scales, so they too
    give the file's exact values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    assert _mod is not None
    g = torch.Generator().manual_seed(rows * 1000 + n + k + qtype)
    raw = _gguf_quantize(torch.randn(n, k, generator=g), qtype)
    w = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType(qtype)),
                                    dtype=np.float64)).view(n, k)
    packed = _mod.pack_gguf_gemm(torch.from_numpy(raw), qtype, k)
    bias = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k, generator=g).to(dtype)
        x[0, :32] = 0  # an all-zero group: scale 0
        for b in (None, bias):
            add = 0 if b is None else b.double()
            ref = _q8_activations(x).double() @ w.T + add
            out = _mod.gguf_gemm(x, packed, qtype, n, b)
            assert out.dtype is dtype and out.shape == (rows, n)
            tol = 1e-5 if dtype is torch.float32 else 1e-2
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * k**0.5)
            exact = x.double() @ w.T + add
            rel = (out.double() - exact).abs().mean() / (exact - add).abs().mean()
            assert rel < 0.01, rel


@pytest.mark.parametrize("qtype", [12, 13, 14, 7], ids=["Q4_K", "Q5_K", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 8, 17])
def test_k_quant_gemm_on_any_block_bytes(isa: str, qtype: int, rows: int) -> None:
    """Any bytes are a valid Q4_K, Q5_K, Q6_K or Q5_1 block (the quantizers write only
    some of them): every 6-bit scale and min of Q4_K and Q5_K, Q6_K's negative int8
    scales and its code -32 (llama.cpp's quantizer writes both), every fifth bit. The
    GEMM gives the gguf package's dequantization of them, to float32 rounding of the
    same sums."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvrelay.testing.gguf_writer import random_blocks

    assert _mod is not None
    n, k = 40, 512
    raw = random_blocks(GGMLQuantizationType(qtype), n, k, seed=rows * 100 + qtype,
                        scales=(1e-4, 1e-3))
    w = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType(qtype)),
                                    dtype=np.float64)).view(n, k)
    if qtype == 14:
        assert (raw.reshape(n, k // 256, -1)[..., 192:208].view(np.int8) < 0).any()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = _mod.gguf_gemm(x, _mod.pack_gguf_gemm(torch.from_numpy(raw), qtype, k), qtype, n)
    ref = _q8_activations(x).double() @ w.T
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("qtype", [8, 3, 12, 14], ids=["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 8, 17])
def test_gguf_gemm_bfloat16_x_gives_the_float32_result_rounded(isa: str, qtype: int,
                                                               rows: int) -> None:
    """bfloat16 x is read and its result rounded inside the call (no conversions around
    it): the float32 call on the same values rounded as .to() rounds, exactly (a NaN's
    bits aside), rows with a stride past K, one row holding an infinity included."""
    assert _mod is not None
    n, k = 80, 96 if qtype in (8, 3) else 256
    g = torch.Generator().manual_seed(rows + qtype)
    raw = _gguf_quantize(torch.randn(n, k, generator=g), qtype)
    packed = _mod.pack_gguf_gemm(torch.from_numpy(raw), qtype, k)
    x = (100 * torch.randn(rows, k + 32, generator=g)).bfloat16()[:, :k]
    x[-1, 5] = float("inf")
    for b in (None, torch.randn(n, generator=g)):
        out = _mod.gguf_gemm(x, packed, qtype, n, b)
        ref = _mod.gguf_gemm(x.float(), packed, qtype, n, b).bfloat16()
        assert out.dtype is torch.bfloat16 and not out[-1].isfinite().any()
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernel", ["f32", "bf16", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 5, 8, 17])
@pytest.mark.parametrize(("i", "k"), [(16, 64), (48, 96), (1536, 576)])
def test_small_gemm_gate_up_silu_equals_the_unfused_path(isa: str, kernel: str, rows: int,
                                                         i: int, k: int) -> None:
    """silu=True on the decode GEMMs (float32, vdpbf16ps, the GGUF codes with float32 and
    bfloat16 x): silu(gate) * up from each thread's own columns gives exactly silu_mul of
    the same GEMM's (rows, 2I) output, with and without a bias; one gate block per
    thread and an odd count included. N not a multiple of 32 is refused."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    assert _mod is not None
    if kernel == "bf16" and not _mod.has_bf16_gemm():
        pytest.skip("the CPU (or the forced ISA) lacks AVX-512 BF16")
    g = torch.Generator().manual_seed(rows * 100 + i + k)
    w = torch.randn(2 * i, k, generator=g)
    bias = torch.randn(2 * i, generator=g)
    runs: list[tuple[Callable[..., torch.Tensor], torch.Tensor]] = []
    if kernel == "f32":
        packed = _mod.pack_f32_gemm(w)
        runs = [(lambda x, b, s: _mod.f32_gemm(x, packed, 2 * i, b, s),
                 torch.randn(rows, k, generator=g))]
    elif kernel == "bf16":
        packed = _mod.pack_bf16_gemm(w.bfloat16())
        runs = [(lambda x, b, s: _mod.bf16_gemm(x, packed, 2 * i, b, s),
                 torch.randn(rows, k, generator=g).bfloat16())]
    else:
        qtype = 8 if kernel == "Q8_0" else 3
        raw = quantize(w.numpy(), GGMLQuantizationType(qtype))
        packed = _mod.pack_gguf_gemm(torch.from_numpy(np.ascontiguousarray(raw)), qtype, k)
        runs = [(lambda x, b, s: _mod.gguf_gemm(x, packed, qtype, 2 * i, b, s),
                 torch.randn(rows, k, generator=g).to(dt))
                for dt in (torch.float32, torch.bfloat16)]
    for run, x in runs:
        for b in (None, bias):
            unfused = _mod.silu_mul(run(x, b, False))
            fused = run(x, b, True)
            assert fused.shape == (rows, i) and fused.dtype is x.dtype
            assert torch.equal(fused, unfused)
        with pytest.raises(RuntimeError, match="multiple of 32"):
            _silu_48(kernel, x, k)


def _silu_48(kernel: str, x: torch.Tensor, k: int) -> None:
    """A fused call with N = 48 (not a multiple of 32)."""
    assert _mod is not None
    w = torch.randn(48, k)
    if kernel == "f32":
        _mod.f32_gemm(x, _mod.pack_f32_gemm(w), 48, None, True)
    elif kernel == "bf16":
        _mod.bf16_gemm(x, _mod.pack_bf16_gemm(w.bfloat16()), 48, None, True)
    else:
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        qtype = 8 if kernel == "Q8_0" else 3
        raw = quantize(w.numpy(), GGMLQuantizationType(qtype))
        _mod.gguf_gemm(x, _mod.pack_gguf_gemm(torch.from_numpy(np.ascontiguousarray(raw)),
                                              qtype, k), qtype, 48, None, True)


def test_gguf_gemm_rejects_bad_input() -> None:
    assert _mod is not None
    raw = torch.zeros(32, 2 * 34, dtype=torch.uint8)
    packed = _mod.pack_gguf_gemm(raw, 8, 64)
    with pytest.raises(RuntimeError, match="Q8_0"):
        _mod.pack_gguf_gemm(raw, 2, 64)
    with pytest.raises(RuntimeError, match="raw must be"):
        _mod.pack_gguf_gemm(raw, 3, 64)  # Q4_1 rows are 2 x 20 bytes
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _mod.pack_gguf_gemm(raw, 8, 48)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        _mod.pack_gguf_gemm(torch.zeros(32, 18 * 4, dtype=torch.uint8), 12, 128)
    with pytest.raises(RuntimeError, match="does not match"):
        _mod.gguf_gemm(torch.randn(2, 64), packed, 8, 48)
    with pytest.raises(RuntimeError, match="does not match"):
        _mod.gguf_gemm(torch.randn(2, 64), packed, 3, 32)
    with pytest.raises(RuntimeError, match="bias"):
        _mod.gguf_gemm(torch.randn(2, 64), packed, 8, 32, torch.ones(3))
    assert _mod.gguf_gemm(torch.empty(0, 64), packed, 8, 32).shape == (0, 32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantization_gguf_serves_the_stored_weights(tmp_path: Path, dtype: str) -> None:
    """--quantization gguf on a GGUF with mixed tensor types: the Q8_0 ones (ffn_down, the
    lm_head) go to the quantized GEMM, and the fused gate/up (gate Q4_0, served as the
    Q4_1 blocks of the same values, up Q4_1); the fused q/k/v, whose parts differ in type
    (Q8_0, Q4_1, F16), keeps the dequantized weights; the logits of 16 positions (decode-sized
    GEMMs) are within the 8-bit activations' error of the dequantized model's (mean
    under 2% of the logits' mean size; a random tiny model's near-ties can flip greedy
    tokens, so the SmolLM2 agreement is measured by `kvrelay bench quant`). An HF
    directory is refused with a message naming the flag."""
    from kvrelay.model.kernels.attention import ChunkSpec
    from kvrelay.model.llm import LLM
    from kvrelay.sampling_params import SamplingParams
    from kvrelay.testing.models import write_tiny_gguf, write_tiny_hf_model

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", seed=4))
    ids = list(range(40, 52))
    logits = {}
    for quant in ("gguf", "none"):
        llm = LLM(path, dtype=dtype, quantization=quant)
        runner = llm.model.runner  # type: ignore[attr-defined]
        model = runner.model
        if quant == "gguf":
            assert kernel_choice.info()["gemm"] == f"native-gguf-{_mod.gguf_isa()}"
            assert isinstance(model.layers[0].down.small.__self__, gemms.NativeGgufGemm)
            assert isinstance(model.lm_head.small.__self__, gemms.NativeGgufGemm)
            assert isinstance(model.layers[0].gate_up.small.__self__, gemms.NativeGgufGemm)
            assert not isinstance(getattr(model.layers[0].qkv.small, "__self__", None),
                                  (gemms.NativeGgufGemm, gemms.NativeGgufParts))
        blocks = list(range(-(-len(ids) // runner.block_size)))
        logits[quant] = runner._forward(ids, list(range(len(ids))),
                                        [ChunkSpec(0, len(ids), blocks)], list(range(len(ids))))
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    diff = (logits["gguf"] - logits["none"]).abs().mean() / logits["none"].abs().mean()
    assert 0 < diff < 0.02, diff
    with pytest.raises(ValueError, match="--quantization gguf"):
        LLM(str(write_tiny_hf_model(tmp_path / "hf")), quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        LLM(path, quantization="int4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantization_gguf_serves_k_quants(tmp_path: Path, dtype: str) -> None:
    """A GGUF typed as llama.cpp's Q4_K_M (Q4_K q, k, gate, up; Q6_K v, down and the
    lm_head; Q5_0 o): every GEMM runs on the stored codes, the fused q/k/v in two calls
    (Q4_K q and k, then Q6_K v: NativeGgufParts), and the logits of 16 positions are
    within the 8-bit activations' error of the dequantized model's (2.2% of the logits'
    mean size here, as with the same model in Q4_1: every layer GEMM of a 4x wider model
    takes the 8-bit activations; a wrong Q4_K scale or code order is ~100%)."""
    from kvrelay.model.llm import LLM
    from kvrelay.testing.models import write_tiny_gguf

    path = str(write_tiny_gguf(tmp_path / "k.gguf", seed=5, k_quants=True))
    ids = list(range(40, 52))
    logits = {}
    for quant in ("gguf", "none"):
        runner = LLM(path, dtype=dtype, quantization=quant).model.runner  # type: ignore[attr-defined]
        model = runner.model
        kernels = [type(getattr(f.small, "__self__", None)) for f in (
            model.layers[1].qkv, model.layers[1].o, model.layers[1].gate_up,
            model.layers[1].down, model.lm_head)]
        if quant == "gguf":
            assert kernels == [gemms.NativeGgufParts] + [gemms.NativeGgufGemm] * 4
        else:
            assert gemms.NativeGgufGemm not in kernels and gemms.NativeGgufParts not in kernels
        blocks = list(range(-(-len(ids) // runner.block_size)))
        logits[quant] = runner._forward(ids, list(range(len(ids))),
                                        [ChunkSpec(0, len(ids), blocks)], list(range(len(ids))))
    diff = (logits["gguf"] - logits["none"]).abs().mean() / logits["none"].abs().mean()
    assert 0 < diff < 0.04, diff


def test_fused_parts_of_different_types_run_as_one_linear() -> None:
    """GgufGemms.pack of parts in different types (Q4_K, Q4_K, Q6_K, Q8_0): one call per
    run of a type over one flat tensor, the outputs side by side, each run's bias slice
    its own: the same as each part's GEMM alone (bit for bit) and within float32
    rounding of the 8-bit activations times the dequantized weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvrelay.model.formats.gguf_loader import QuantWeight

    assert _mod is not None
    g = torch.Generator().manual_seed(7)
    k, rows = 512, [48, 16, 16, 32]
    types = [12, 12, 14, 8]
    raws = [_gguf_quantize(torch.randn(n, k, generator=g), t)
            for n, t in zip(rows, types, strict=True)]
    quantized = {f"p{i}": QuantWeight(t, torch.from_numpy(r), k)
                 for i, (t, r) in enumerate(zip(types, raws, strict=True))}
    model_gemms = gemms.GgufGemms(_mod, quantized)
    served = model_gemms.pack([f"p{i}" for i in range(4)])
    assert served is not None
    kernel, flat = served
    assert isinstance(kernel, gemms.NativeGgufParts) and flat.dtype is torch.uint8
    x, bias = torch.randn(5, k, generator=g), torch.randn(sum(rows), generator=g)
    out = kernel.run(x, flat, sum(rows), bias)
    alone = torch.cat([
        _mod.gguf_gemm(x, _mod.pack_gguf_gemm(torch.from_numpy(np.concatenate(raws[:2])), 12, k),
                       12, 64, bias[:64]),
        _mod.gguf_gemm(x, _mod.pack_gguf_gemm(torch.from_numpy(raws[2]), 14, k), 14, 16,
                       bias[64:80]),
        _mod.gguf_gemm(x, _mod.pack_gguf_gemm(torch.from_numpy(raws[3]), 8, k), 8, 32,
                       bias[80:]),
    ], dim=1)
    assert torch.equal(out, alone)
    w = torch.cat([torch.from_numpy(np.asarray(dequantize(r, GGMLQuantizationType(t)),
                                               dtype=np.float64)).view(-1, k)
                   for r, t in zip(raws, types, strict=True)])
    ref = _q8_activations(x).double() @ w.T + bias.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)
    assert kernel.run_silu(x, flat, sum(rows), bias) is None
    # K = 96: a Q8_0 run of 16 rows is 1,632 bytes, so the Q4_1 run after it starts
    # 32 bytes of padding further on
    raws = [_gguf_quantize(torch.randn(16, 96, generator=g), t) for t in (8, 3)]
    parts = {f"p{i}": QuantWeight(t, torch.from_numpy(r), 96)
             for i, (t, r) in enumerate(zip((8, 3), raws, strict=True))}
    model_gemms = gemms.GgufGemms(_mod, parts)
    served = model_gemms.pack(["p0", "p1"])
    assert served is not None
    kernel, flat = served
    assert flat.numel() == 1632 + 32 + 960
    x = torch.randn(3, 96, generator=g)
    alone = [_mod.gguf_gemm(x, _mod.pack_gguf_gemm(torch.from_numpy(r), t, 96), t, 16)
             for t, r in zip((8, 3), raws, strict=True)]
    assert torch.equal(kernel.run(x, flat, 32, None), torch.cat(alone, dim=1))


def test_q4_0_and_q5_0_are_served_as_blocks_of_the_same_values() -> None:
    """The loader's rewrites, Q4_0 -> Q4_1 (min -8 d) and Q5_0 -> Q8_0 (codes q - 16),
    decode to the same floats, bit for bit; a Q4_0 scale whose -8 d overflows f16 leaves
    the tensor to be dequantized."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from kvrelay.model.formats.gguf_loader import q4_0_as_q4_1, q5_0_as_q8_0

    w = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    q5 = quantize(w, Q.Q5_0)
    as_q8 = q5_0_as_q8_0(q5)
    assert as_q8.shape == (8, 4 * 34)
    assert np.array_equal(dequantize(as_q8, Q.Q8_0), dequantize(q5, Q.Q5_0))

    raw = quantize(np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32), Q.Q4_0)
    as_q41 = q4_0_as_q4_1(raw)
    assert as_q41 is not None and as_q41.shape == (8, 4 * 20)
    assert np.array_equal(dequantize(as_q41, Q.Q4_1), dequantize(raw, Q.Q4_0))
    big = raw.copy()
    big[0, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)
    assert q4_0_as_q4_1(big) is None


def test_quantization_auto_serves_the_codes_where_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default, ``auto``: a GGUF's codes when the native kernels run; the
    float weights for an HF directory, and (not an error, as ``gguf`` is) where the
    native kernels were not chosen. In every dtype and ISA the codes serve prefill-sized
    calls too, without oneDNN's copy of the float weight."""
    from kvrelay.model.llm import LLM
    from kvrelay.testing.models import write_tiny_gguf, write_tiny_hf_model

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", seed=4))
    for dtype in ("float32", "bfloat16") if _mod.has_bf16_gemm() else ("float32",):
        model = LLM(path, dtype=dtype).model.runner.model  # type: ignore[attr-defined]
        assert kernel_choice.info()["gemm"] == f"native-gguf-{_mod.gguf_isa()}"
        assert kernel_choice.info()["prefill_gemm"] == f"native-gguf-{_mod.gguf_isa()}"
        down = model.layers[0].down
        assert isinstance(down.small.__self__, gemms.NativeGgufGemm)
        assert down.small_rows >= gemms.GGUF_GEMM_ROWS_EVERY and down.packed is None
    LLM(str(write_tiny_hf_model(tmp_path / "hf")), dtype="float32")
    assert not kernel_choice.info()["gemm"].startswith("native-gguf")
    monkeypatch.setenv("KVRELAY_KERNELS", "torch")
    LLM(path, dtype="float32")
    assert not kernel_choice.info()["gemm"].startswith("native-gguf")
    with pytest.raises(ValueError, match="--quantization gguf needs the native kernels"):
        LLM(path, dtype="float32", quantization="gguf")


def test_a_module_built_from_other_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's bindings API must be the one this kvrelay speaks: a module built
    before attention() took skip_from (an int where skip_fresh was a bool, which pybind11
    would convert silently) is refused at load with a reason, and the torch kernels run."""
    assert _mod is not None and _mod.API == ext.API

    class Old:
        @staticmethod
        def isa() -> str:
            return "avx512"

    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_load_error", None)
    monkeypatch.setattr(ext.importlib, "import_module", lambda name: Old())
    assert ext.load() is None
    assert "bindings API 1" in (ext.load_error() or "")
