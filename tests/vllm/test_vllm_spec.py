"""Speculative decoding on D only (issue 41 item 4; `make test-vllm-slow`,
KVRELAY_VLLM_SLOW=1): a pair (pair.py, tcp) whose P (kv_producer) has no drafter and
whose D (kv_consumer) runs vLLM's speculative decoding, once per method:

- ``eagle``: a one-layer EAGLE drafter for SmolLM2 with random weights, written through
  the Hugging Face format (config.json and model.safetensors; embeddings and LM head
  shared with the target, as vLLM does for a checkpoint without them). Its KV layer
  (``model.layers.30.self_attn.attn``) lives in D's KV cache beside the target's 30;
  the lease covers the target's alone, so P's and D's compat agree;
- ``ngram``: prompt lookup, no KV layers (the compat is the one without a drafter).

Greedy texts through the proxy equal colocated vLLM's (P asked alone), every request's
KV pulled (no fallback in D's log), and D's drafter drafted tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.vllm.pair import (
    FELL_BACK,
    MODEL,
    PULLING,
    SLOW_MARKS,
    Pair,
    chat,
    colocated,
    completion,
    start_pair,
)

pytestmark = SLOW_MARKS
COMPAT = r"kvrelay: worker relay threads on CPUs \S+ \(block layout (\S+), compat (\w+)\)"
# A prompt that repeats itself, so ngram's prompt lookup has something to propose.
REPEATING = "one two three four, one two three four, one two three four, one two"


def write_eagle_drafter(path: Path) -> Path:
    """A one-layer EAGLE head for SmolLM2 (vLLM's EagleLlamaForCausalLM: ``fc`` over
    [embedding, hidden state], one decoder layer without its input norm), random
    weights, seeded."""
    cfg = json.loads((MODEL / "config.json").read_text())
    cfg.update(num_hidden_layers=1, intermediate_size=256, architectures=["LlamaForCausalLM"])
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"fc.weight": (hidden, 2 * hidden),
              "layers.0.self_attn.q_proj.weight": (heads * cfg["head_dim"], hidden),
              "layers.0.self_attn.k_proj.weight": (kv, hidden),
              "layers.0.self_attn.v_proj.weight": (kv, hidden),
              "layers.0.self_attn.o_proj.weight": (hidden, heads * cfg["head_dim"]),
              "layers.0.mlp.gate_proj.weight": (256, hidden),
              "layers.0.mlp.up_proj.weight": (256, hidden),
              "layers.0.mlp.down_proj.weight": (hidden, 256)}
    gen = torch.Generator().manual_seed(41)
    weights = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))
    return path


def spec_config(method: str, tmp: Path) -> dict[str, object]:
    if method == "eagle":
        return {"method": "eagle", "model": str(write_eagle_drafter(tmp / "eagle")),
                "num_speculative_tokens": 3}
    return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}


@pytest.fixture(scope="module", params=["eagle", "ngram"])
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp(f"vllm-spec-{request.param}")
    yield from start_pair(tmp, "tcp", "kv_producer", d_args=(
        "--speculative-config", json.dumps(spec_config(request.param, tmp))))


def test_p_and_d_agree_on_the_target_models_layers(pair: Pair) -> None:
    p = re.findall(COMPAT, pair.p.log.read_text())
    d = re.findall(COMPAT, pair.d.log.read_text())
    assert p and p == d, (p, d)
    assert p[0][0].startswith("regions:30x")  # SmolLM2's 30 layers, no drafter's
    if "eagle" in pair.d.args[-1]:
        assert pair.d.count(r"the drafter's 1 \(model\.layers\.30\.self_attn\.attn\) "
                            r"stay local") == 1


@pytest.mark.parametrize("kind", ["completion", "chat", "repeating"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_texts_equal_colocated_vllm_with_every_kv_pulled(pair: Pair, kind: str,
                                                         stream: bool) -> None:
    if kind == "chat":
        want = chat(pair.p.url, False)
    else:
        prompt = REPEATING if kind == "repeating" else None
        want = colocated(pair, prompt) if prompt else colocated(pair)
    pulls, fallbacks = pair.d.count(PULLING), pair.d.count(FELL_BACK)
    if kind == "chat":
        got = chat(pair.proxy_url, stream)
    else:
        got = (completion(pair.proxy_url, stream, REPEATING) if kind == "repeating"
               else completion(pair.proxy_url, stream))
    assert got == want
    assert pair.d.count(PULLING) == pulls + 1  # the KV came over the relay
    assert pair.d.count(FELL_BACK) == fallbacks  # and was not recomputed


def test_d_drafted_tokens(pair: Pair) -> None:
    """vLLM's spec decoding ran on D (its stat logger, every 10 s)."""
    pair.d.wait_log(r"SpecDecoding metrics: .*Drafted: [1-9]\d* tokens", 1, timeout=30)
