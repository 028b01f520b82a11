"""Paged attention over the block-major KV cache.

The cache ``(num_blocks, num_layers, 2, block_size, kv_heads, head_dim)`` is
addressed as rows of ``kv_heads * head_dim`` values: the K row of token slot
(block, offset) in layer l is ``((block * num_layers + l) * 2) * block_size + offset``
and its V row is ``block_size`` further. Metadata holds layer-0 K rows; a layer
reads and writes through a view of the cache that starts its constant number of rows
in. Writes are one ``index_copy_`` per layer, reads one ``index_select``
(a row memcpy): measured on the 135M model's shapes, 4x faster than advanced
indexing of a strided per-layer view (docs/model.md).

Decode rows (one query each) are batched into one padded attention with a length
mask, done as two batched matmuls over (request, KV head) pairs: for that the
context is gathered as rows of ``head_dim`` (one KV head of one slot), which lands
K/V directly in (request, KV head, position, head_dim) order; 1.6x faster than
scaled_dot_product_attention on strided views at these shapes. Prefill chunks run
one attention per chunk, since their query lengths differ and padding them to a
common length would waste compute; adjacent chunks that start their sequences and
have one length (a batch of equal prompts) share one batched attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # slice of the step's flat token dimension
    token_end: int
    ctx_len: int  # context after this chunk: start + chunk length
    # A chunk that starts its sequence attends causally to its own fresh K/V: no
    # gather (kv_rows and mask None). Adjacent fresh chunks of one length are
    # merged into one entry of `count` sequences, run as one batched attention
    # (16 prompts of 128 tokens: 1.35x faster than 16 calls).
    count: int
    kv_rows: torch.Tensor | None  # (2 * ctx_len,) long: K rows of every position, then V
    mask: torch.Tensor | None  # (chunk_len, ctx_len) bool, True = may attend


@dataclass(slots=True)
class AttnMetadata:
    layer_stride: int  # rows between one layer and the next within a block: 2 * block_size
    write_rows: torch.Tensor  # (2T,) long: K rows of the step's tokens, then V rows
    decode_rows: torch.Tensor | None  # (Bd,) long: flat token index of each decode row
    # (2 * Bd * KVH * max_ctx,) long: head rows (of head_dim values) of every decode
    # context position, K then V, in (request, head, position) order; padding points
    # at row 0 and is masked.
    decode_head_rows: torch.Tensor | None
    decode_ctx: int
    # (Bd * KVH, 1, max_ctx) in the compute dtype: 0 or -inf, added to the scores of
    # each (request, KV head) pair by the same baddbmm that computes them.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    all_decode: bool  # every token is a decode row, in order: no scatter of outputs


@dataclass(slots=True)
class ChunkSpec:
    start: int  # position of the chunk's first token
    length: int
    block_ids: Sequence[int]


def build_metadata(
    chunks: Sequence[ChunkSpec],
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> AttnMetadata:
    block_rows = num_layers * 2 * block_size
    slots: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[Sequence[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    t = 0
    for c in chunks:
        end = c.start + c.length
        bt = c.block_ids
        slots.extend(bt[p // block_size] * block_rows + p % block_size for p in range(c.start, end))
        n_ctx_blocks = -(-end // block_size)
        if c.length == 1:
            dec_rows.append(t)
            dec_tables.append(bt[:n_ctx_blocks])
            dec_lens.append(end)
        else:
            table = torch.tensor(list(bt[:n_ctx_blocks]), dtype=torch.long, device=device)
            _add_prefill(prefills, c, t, table, block_size, block_rows)
        t += c.length
    k_rows = torch.tensor(slots, dtype=torch.long, device=device)
    meta = _writes_only(k_rows, block_size, prefills, all_decode=len(dec_rows) == t)
    if dec_rows:
        width = max(len(b) for b in dec_tables)
        padded = [list(b) + [0] * (width - len(b)) for b in dec_tables]
        tables = torch.tensor(padded, dtype=torch.long, device=device)
        lens = torch.tensor(dec_lens, dtype=torch.long, device=device)
        meta.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
        _set_decode(meta, tables, lens, max(dec_lens), block_size, block_rows, num_kv_heads, dtype)
    return meta


def _writes_only(k_rows: torch.Tensor, block_size: int, prefills: list[PrefillChunk],
                 *, all_decode: bool) -> AttnMetadata:
    """Metadata that writes the step's K/V rows (``k_rows``: each token's K row in layer
    0; V follows ``block_size`` rows later); the decode part is set by ``_set_decode``."""
    return AttnMetadata(
        layer_stride=2 * block_size,
        write_rows=torch.cat([k_rows, k_rows + block_size]),
        decode_rows=None,
        decode_head_rows=None,
        decode_ctx=0,
        decode_mask=None,
        prefills=prefills,
        all_decode=all_decode,
    )


def static_decode_metadata(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> AttnMetadata:
    """A decode-only step's metadata from device tensors alone, with shapes fixed by
    the tensors' shapes (no host sync, no data-dependent size): what a CUDA graph can
    capture. ``block_tables`` (B, W) block ids, ``context_lens`` (B,) tokens after this
    step (each >= 1), ``slot_mapping`` (B,) the cache slot (block * block_size +
    offset) each row's K/V goes to. Every row attends over W * block_size positions,
    masked past its own length; table entries past a row's blocks must still be
    valid block ids (they are read, then masked)."""
    block_rows = num_layers * 2 * block_size
    k_rows = (slot_mapping // block_size) * block_rows + slot_mapping % block_size
    meta = _writes_only(k_rows, block_size, [], all_decode=True)
    ctx = block_tables.shape[1] * block_size
    _set_decode(meta, block_tables, context_lens, ctx, block_size, block_rows, num_kv_heads, dtype)
    return meta


def _set_decode(
    meta: AttnMetadata,
    tables: torch.Tensor,
    lens: torch.Tensor,
    ctx: int,
    block_size: int,
    block_rows: int,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> None:
    """The decode rows' gather indices and length mask over ``ctx`` positions."""
    device = tables.device
    pos = torch.arange(ctx, device=device)
    rows = tables.shape[0]
    k = tables.gather(1, (pos // block_size).expand(rows, -1)) * block_rows + pos % block_size
    heads = torch.arange(num_kv_heads, device=device)
    k_heads = (k[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    meta.decode_head_rows = torch.cat([k_heads, k_heads + block_size * num_kv_heads])
    meta.decode_ctx = ctx
    # expand + reshape, not repeat_interleave: no host sync, so a graph can capture it.
    valid = (pos[None, :] < lens[:, None])[:, None, :].expand(rows, num_kv_heads, ctx)
    valid = valid.reshape(rows * num_kv_heads, 1, ctx)
    mask = torch.zeros(valid.shape, dtype=dtype, device=device)
    meta.decode_mask = mask.masked_fill(~valid, -torch.inf)


def _add_prefill(
    prefills: list[PrefillChunk],
    c: ChunkSpec,
    t: int,
    table: torch.Tensor,
    block_size: int,
    block_rows: int,
) -> None:
    end = c.start + c.length
    if c.start == 0:
        last = prefills[-1] if prefills else None
        if last and last.mask is None and last.token_end == t and last.ctx_len == c.length:
            last.token_end += c.length
            last.count += 1
        else:
            prefills.append(PrefillChunk(t, t + c.length, c.length, 1, None, None))
        return
    pos = torch.arange(end, device=table.device)
    mask = pos[None, :] <= pos[c.start :, None]
    k = table[pos // block_size] * block_rows + pos % block_size
    prefills.append(PrefillChunk(t, t + c.length, end, 1, torch.cat([k, k + block_size]), mask))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_rows: torch.Tensor,
    layer: int,
    meta: AttnMetadata,
) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D); kv_rows: the whole cache viewed as
    (rows, KVH * D). Writes k/v into ``layer``, returns attention output (T, H * D).
    A cache of another dtype (--kv-cache-dtype) holds k/v rounded to it; every read,
    the new tokens' own k/v included, sees those rounded values in q's dtype (as the
    native kernels, which read everything back from the cache)."""
    T, H, D = q.shape
    shift = layer * meta.layer_stride
    kv_new = torch.cat([k, v]).reshape(2 * T, -1)
    if kv_rows.dtype != q.dtype:
        kv_new = kv_new.to(kv_rows.dtype)
        if not meta.all_decode:  # a prefill attends to the new k/v as the cache holds them
            k, v = kv_new.to(q.dtype).view(2, T, -1, D).unbind(0)
    # The layer's rows are the layer-0 rows of a view starting `shift` rows in: no
    # per-layer addition over the index tensors.
    kv_rows[shift:].index_copy_(0, meta.write_rows, kv_new)
    if meta.all_decode:
        return _decode(q, kv_rows, layer, meta).reshape(T, H * D)
    out = q.new_empty(T, H, D)
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        out[rows] = _decode(q[rows], kv_rows, layer, meta)
    for p in meta.prefills:
        s, e = p.token_start, p.token_end
        out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv_rows, shift, p)
    return out.reshape(T, H * D)


def _decode(q: torch.Tensor, kv_rows: torch.Tensor, layer: int, meta: AttnMetadata) -> torch.Tensor:
    """One query per row. GQA without expanding K/V: the G query heads that share
    a KV head become G query rows of that head."""
    assert meta.decode_head_rows is not None and meta.decode_mask is not None
    B, H, D = q.shape
    kvh = kv_rows.shape[1] // D
    g, ctx = H // kvh, meta.decode_ctx
    shift = layer * meta.layer_stride * kvh
    kv = kv_rows.view(-1, D)[shift:].index_select(0, meta.decode_head_rows)
    kv = kv.view(2, B * kvh, ctx, D).to(q.dtype)
    qg = q.reshape(B * kvh, g, D)
    # One op for scores, scale and mask. The softmax stays in float32: bfloat16's own
    # softmax kernel rounds differently and flipped a greedy token in the benchmark.
    scores = torch.baddbmm(meta.decode_mask, qg, kv[0].transpose(1, 2), alpha=D**-0.5)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, kv[1]).view(B, H, D)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_rows: torch.Tensor,
    shift: int,
    p: PrefillChunk,
) -> torch.Tensor:
    n, H, D = q.shape
    if p.kv_rows is None:
        seqs = (p.count, n // p.count)
        qh, kh, vh = (x.view(*seqs, -1, D).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(n, H, D)
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
    kv = kv_rows[shift:].index_select(0, p.kv_rows).view(2, p.ctx_len, -1, D).to(q.dtype)
    kh = kv[0].transpose(0, 1).unsqueeze(0)
    vh = kv[1].transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=p.mask, enable_gqa=True)
    return o[0].transpose(0, 1)
