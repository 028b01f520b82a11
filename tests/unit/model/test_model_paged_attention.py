"""Paged attention equals contiguous causal attention for random block tables,
chunk sizes and mixed prefill/decode batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvrelay.model.kernels.attention import ChunkSpec, build_metadata, paged_attention

H, KVH, D, BS, NB = 4, 2, 8, 4, 64


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a whole sequence; q (L, H, D), k/v (L, KVH, D)."""
    L = q.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(L, H * D)


@pytest.mark.parametrize("seed", range(12))
def test_paged_equals_contiguous(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    free = list(range(NB))
    rng.shuffle(free)
    seqs = []
    for _ in range(rng.randint(1, 5)):
        length = rng.randint(1, 30)
        blocks = [free.pop() for _ in range(-(-length // BS))]
        q = torch.randn(length, H, D)
        k, v = torch.randn(length, KVH, D), torch.randn(length, KVH, D)
        seqs.append(
            {
                "len": length,
                "blocks": blocks,
                "q": q,
                "k": k,
                "v": v,
                "done": 0,
                "out": torch.empty(length, H * D),
            }
        )
    layers, layer = 3, 1
    cache = torch.zeros(NB, layers, 2, BS, KVH, D)
    rows = cache.view(-1, KVH * D)
    # Steps of a random mix: each unfinished sequence computes a random-size chunk
    # (size 1 = a decode row), all in one batch.
    while any(s["done"] < s["len"] for s in seqs):
        batch = [s for s in seqs if s["done"] < s["len"] and rng.random() < 0.8]
        if not batch:
            continue
        chunks, spans = [], []
        for s in batch:
            n = rng.choice([1, 1, rng.randint(1, s["len"] - s["done"])])
            n = min(n, s["len"] - s["done"])
            chunks.append(ChunkSpec(s["done"], n, s["blocks"]))
            spans.append((s, s["done"], s["done"] + n))
            s["done"] += n
        q = torch.cat([s["q"][a:b] for s, a, b in spans])
        k = torch.cat([s["k"][a:b] for s, a, b in spans])
        v = torch.cat([s["v"][a:b] for s, a, b in spans])
        meta = build_metadata(chunks, BS, layers, KVH, torch.device("cpu"))
        out = paged_attention(q, k, v, rows, layer, meta)
        t = 0
        for s, a, b in spans:
            s["out"][a:b] = out[t : t + b - a]
            t += b - a
    # Only this layer's slots were written: K of position p sits in its block's slot.
    assert cache[:, 0].abs().sum() == 0 and cache[:, 2].abs().sum() == 0
    s = seqs[0]
    last = s["len"] - 1
    slot = cache[s["blocks"][last // BS], layer, :, last % BS]
    assert torch.equal(slot[0], s["k"][last]) and torch.equal(slot[1], s["v"][last])
    for s in seqs:
        torch.testing.assert_close(
            s["out"], _reference(s["q"], s["k"], s["v"]), atol=1e-5, rtol=1e-5
        )


def test_same_length_prompts_in_one_step_equal_contiguous() -> None:
    """Adjacent fresh prompts of one length run as one batched attention; a prompt
    of another length between them starts a new batch."""
    torch.manual_seed(0)
    lengths = [6, 6, 6, 3, 6, 6, 5]
    cache = torch.zeros(NB, 2, 2, BS, KVH, D)
    chunks, qs, ks, vs = [], [], [], []
    next_block = 0
    for n in lengths:
        blocks = list(range(next_block, next_block + -(-n // BS)))
        next_block += len(blocks)
        chunks.append(ChunkSpec(0, n, blocks))
        qs.append(torch.randn(n, H, D))
        ks.append(torch.randn(n, KVH, D))
        vs.append(torch.randn(n, KVH, D))
    meta = build_metadata(chunks, BS, 2, KVH, torch.device("cpu"))
    rows = cache.view(-1, KVH * D)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), rows, 1, meta)
    expected = torch.cat([_reference(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
