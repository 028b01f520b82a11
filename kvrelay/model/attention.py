"""Paged attention over the block-major KV cache.

Per layer, the cache is viewed as ``(num_blocks, 2, block_size, kv_heads, head_dim)``
(a strided view of the one block-major tensor). The step's K/V are written with one
indexed store per layer; attention then reads each request's context through its
block table. Decode rows (one query each) are batched into one padded attention
with a length mask; prefill chunks run one attention per chunk, since their query
lengths differ and padding them to a common length would waste compute.
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
    block_table: torch.Tensor  # (num_context_blocks,) long
    ctx_len: int  # context after this chunk: start + chunk length
    # (chunk_len, ctx_len) bool, True = may attend; None when the chunk starts the
    # sequence, so it attends causally to its own fresh K/V without a gather.
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttnMetadata:
    write_blocks: torch.Tensor  # (T,) long: block of each token's KV slot
    write_offsets: torch.Tensor  # (T,) long: offset within the block
    decode_rows: torch.Tensor | None  # (Bd,) long: flat token index of each decode row
    decode_tables: torch.Tensor | None  # (Bd, max_blocks) long, padded with block 0
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_blocks * block_size) bool
    prefills: list[PrefillChunk]
    # Every token is a decode row, in order: no scatter of outputs needed.
    all_decode: bool


@dataclass(slots=True)
class ChunkSpec:
    start: int  # position of the chunk's first token
    length: int
    block_ids: Sequence[int]


def build_metadata(
    chunks: Sequence[ChunkSpec], block_size: int, device: torch.device
) -> AttnMetadata:
    blocks: list[int] = []
    offsets: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[Sequence[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    t = 0
    for c in chunks:
        end = c.start + c.length
        bt = c.block_ids
        blocks.extend(bt[p // block_size] for p in range(c.start, end))
        offsets.extend(p % block_size for p in range(c.start, end))
        n_ctx_blocks = -(-end // block_size)
        if c.length == 1:
            dec_rows.append(t)
            dec_tables.append(bt[:n_ctx_blocks])
            dec_lens.append(end)
        else:
            prefills.append(_prefill_chunk(c, t, n_ctx_blocks, device))
        t += c.length
    meta = AttnMetadata(
        write_blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        write_offsets=torch.tensor(offsets, dtype=torch.long, device=device),
        decode_rows=None,
        decode_tables=None,
        decode_mask=None,
        prefills=prefills,
        all_decode=len(dec_rows) == t,
    )
    if dec_rows:
        width = max(len(b) for b in dec_tables)
        padded = [list(b) + [0] * (width - len(b)) for b in dec_tables]
        meta.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
        meta.decode_tables = torch.tensor(padded, dtype=torch.long, device=device)
        lens = torch.tensor(dec_lens, dtype=torch.long, device=device)
        keys = torch.arange(width * block_size, device=device)
        meta.decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    return meta


def _prefill_chunk(c: ChunkSpec, t: int, n_ctx_blocks: int, device: torch.device) -> PrefillChunk:
    end = c.start + c.length
    mask = None
    if c.start > 0:
        q_pos = torch.arange(c.start, end, device=device)
        mask = torch.arange(end, device=device)[None, :] <= q_pos[:, None]
    table = torch.tensor(list(c.block_ids[:n_ctx_blocks]), dtype=torch.long, device=device)
    return PrefillChunk(t, t + c.length, table, end, mask)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata
) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D); cache: this layer's (NB, 2, bs, KVH, D) view.

    Writes k/v into the cache, then returns the attention output (T, H * D).
    """
    cache[meta.write_blocks, :, meta.write_offsets] = torch.stack((k, v), dim=1)
    T, H, D = q.shape
    if meta.all_decode:
        assert meta.decode_tables is not None and meta.decode_mask is not None
        return _decode(q, cache, meta.decode_tables, meta.decode_mask).reshape(T, H * D)
    out = q.new_empty(T, H, D)
    if meta.decode_rows is not None:
        assert meta.decode_tables is not None and meta.decode_mask is not None
        rows = meta.decode_rows
        out[rows] = _decode(q[rows], cache, meta.decode_tables, meta.decode_mask)
    for p in meta.prefills:
        s, e = p.token_start, p.token_end
        out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], cache, p)
    return out.reshape(T, H * D)


def _decode(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One query per row. GQA without expanding K/V: the G query heads that share
    a KV head become G query rows of that head."""
    B, H, D = q.shape
    kvh = cache.shape[3]
    kv = cache[tables]  # (B, nb, 2, bs, KVH, D)
    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, B, kvh, -1, D)
    o = F.scaled_dot_product_attention(q.view(B, kvh, H // kvh, D), kv[0], kv[1], attn_mask=mask)
    return o.reshape(B, H, D)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, p: PrefillChunk
) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
    if p.mask is None:
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        kvh, D = cache.shape[3], cache.shape[4]
        kv = cache[p.block_table]  # (nb, 2, bs, KVH, D)
        kv = kv.permute(1, 3, 0, 2, 4).reshape(2, 1, kvh, -1, D)[:, :, :, : p.ctx_len]
        o = F.scaled_dot_product_attention(qh, kv[0], kv[1], attn_mask=p.mask, enable_gqa=True)
    return o[0].transpose(0, 1)
