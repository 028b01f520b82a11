"""Our model equals transformers: logits within 1e-4 (float32) for a prefill and 16
decode steps through the paged cache with scattered block tables; greedy tokens match."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvrelay.core.runner import Batch, ScheduledRequest
from kvrelay.model import load_model
from kvrelay.model.loader import Model
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.models import write_tiny_gguf, write_tiny_hf_model

transformers = pytest.importorskip("transformers")

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "mistral", "gguf"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(our model, the transformers reference on the same weights)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gguf":
        path = write_tiny_gguf(root / "tiny.gguf", seed=3, reference_dir=root / "ref")
        ref_dir = root / "ref"
    else:
        path = ref_dir = write_tiny_hf_model(root / "hf", arch=request.param, seed=1)
    # the GGUF dequantized, as transformers reads it (auto serves the Q8_0/Q4_1 codes
    # with 8-bit activations: test_model_native_kernels and bench quant measure that)
    ours = load_model(str(path), dtype="float32", block_size=BLOCK, num_blocks=64,
                      quantization="none")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    return ours, ref.eval()


def _ref_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _step(model: Model, rid: str, chunk: list[int], start: int, blocks: list[int]) -> torch.Tensor:
    sr = ScheduledRequest(rid, chunk, start, blocks, True, GREEDY, 0)
    _, logits = model.runner.compute_logits(Batch(0, [sr]))
    return logits[0]


def test_prefill_and_decode_logits_match(pair: tuple[Model, torch.nn.Module]) -> None:
    ours, ref = pair
    rng = random.Random(0)
    vocab = ours.config.vocab_size
    ids = [rng.randrange(3, vocab) for _ in range(21 + 16)]
    blocks = rng.sample(range(ours.num_blocks), 10)  # scattered, out of order
    expect = _ref_logits(ref, ids)
    # The prompt in two chunks (chunked prefill), then one token per step.
    got = [_step(ours, "a", ids[:9], 0, blocks), _step(ours, "a", ids[9:21], 9, blocks)]
    got += [_step(ours, "a", [ids[p]], p, blocks) for p in range(21, len(ids))]
    positions = [8, *range(20, len(ids))]
    for pos, logits in zip(positions, got, strict=True):
        torch.testing.assert_close(logits, expect[pos], atol=1e-4, rtol=0)


def test_greedy_generation_matches(pair: tuple[Model, torch.nn.Module]) -> None:
    ours, ref = pair
    prompt = ours.tokenizer.encode("What is the capital of France?")
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expect = out[0, len(prompt) :].tolist()
    blocks = random.Random(1).sample(range(ours.num_blocks), 16)
    got = [int(_step(ours, "g", prompt, 0, blocks).argmax())]
    for i in range(23):
        got.append(int(_step(ours, "g", [got[-1]], len(prompt) + i, blocks).argmax()))
    assert got == expect


def test_gguf_tokenizer_equals_hf_tokenizer(tmp_path: Path) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "t.gguf", reference_dir=tmp_path / "ref")
    a = load_model(str(gguf_path), num_blocks=4).tokenizer
    b = load_model(str(tmp_path / "ref"), num_blocks=4).tokenizer
    text = "<|im_start|>user\nHello naïve café 日本語 😀 123<|im_end|>"
    assert a.encode(text) == b.encode(text)
    assert a.decode(a.encode(text), skip_special_tokens=False) == text
    assert a.eos_token_ids == b.eos_token_ids == [2]
