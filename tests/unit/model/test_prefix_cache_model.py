"""Prefix caching on a real (tiny, random) model: greedy outputs equal those without
caching, with hits, shared blocks and evictions under a tight pool."""

from __future__ import annotations

import pytest

import kvrelay
from kvrelay.testing.models import write_tiny_hf_model

SYSTEM = "You are a careful assistant. Answer in one short sentence, please. "
TAILS = ["Name a color.", "Name a fruit.", "Name a city.", "Count to three.", "Say hi.",
         "Name a tree."]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_hf_model(tmp_path_factory.mktemp("prefix") / "llama", seed=7))


def make(path: str, caching: bool, num_blocks: int) -> kvrelay.LLM:
    return kvrelay.LLM(path, dtype="float32", block_size=4, num_blocks=num_blocks,
                       max_num_batched_tokens=48,
                       enable_prefix_caching=caching)


def test_greedy_outputs_equal_without_caching(model_path: str) -> None:
    params = kvrelay.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [SYSTEM + t for t in TAILS]
    plain = make(model_path, False, 256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert plain.engine.scheduler.prefix_stats.hits == 0 and plain.engine.pool.num_cached == 0
    # Roomy pool: batched, then one by one (every later request hits the prefix).
    cached = make(model_path, True, 256)
    assert [o.outputs[0].token_ids for o in cached.generate(prompts, params)] == want
    for prompt, tokens in zip(prompts, want, strict=True):
        assert cached.generate(prompt, params)[0].outputs[0].token_ids == tokens
    stats, pool = cached.engine.scheduler.prefix_stats, cached.engine.pool
    prefix_len = len(cached.tokenizer.encode(SYSTEM))
    assert stats.hits >= len(prompts) * (prefix_len // 4 - 1) * 4
    assert pool.num_in_use == 0 and pool.num_cached > 0
    pool.check_integrity()
    # A pool too small for all of it at once: evictions, preemptions, same tokens.
    tight = make(model_path, True, 40)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
    assert [o.outputs[0].token_ids for o in tight.generate(prompts[::-1], params)] == want[::-1]
    assert tight.engine.pool.num_evictions > 0 and tight.engine.scheduler.prefix_stats.hits > 0
    tight.engine.pool.check_integrity()
