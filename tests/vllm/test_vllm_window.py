"""A sliding-window model inside vLLM with KvRelayConnector (`make test-vllm-slow`,
KVRELAY_VLLM_SLOW=1): vLLM turns its hybrid allocator off for a connector that is not
``SupportsHMA``, so a model whose layers attend within a window runs with one KV cache
group (every layer's KV kept in full) and the lease moves it whole. A tiny Mistral with
a 32-token window (random weights, written in the Hugging Face format), prompts past
the window: greedy texts through the proxy equal colocated vLLM's, every request
pulled (no fallback). docs/vllm.md, hybrid models."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvrelay.testing.models import tiny_hf_config, tiny_tokenizer_json, tiny_weights, write_hf_dir
from tests.vllm.pair import FELL_BACK, PULLING, SLOW_MARKS, Pair, completion

pytestmark = SLOW_MARKS


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("vllm-window")
    tok = tiny_tokenizer_json()
    cfg = tiny_hf_config("mistral", len(json.loads(tok)["model"]["vocab"]))
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
               sliding_window=32)
    model = write_hf_dir(tmp / "window", cfg, tiny_weights(cfg, seed=5), tok)
    pr = Pair(tmp, "tcp", "kv_both", model=model, d_env={"KVRELAY_FAULT_TRANSFER_DELAY_S": "0"})
    try:
        pr.start()
        yield pr
    finally:
        pr.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_sliding_window_model_pulls_and_answers_as_colocated(pair: Pair, stream: bool) -> None:
    assert "Turning off hybrid kv cache manager" in pair.p.tail(10**7)
    for n in (3, 12):  # prompts of about 40 and 150 tokens: past the 32-token window
        prompt = "The quick brown fox jumps over the lazy dog. " * n
        want = completion(pair.p.url, False, prompt)
        pulls, fallbacks = pair.d.count(PULLING), pair.d.count(FELL_BACK)
        assert completion(pair.proxy_url, stream, prompt) == want
        assert pair.d.count(PULLING) == pulls + 1 and pair.d.count(FELL_BACK) == fallbacks
