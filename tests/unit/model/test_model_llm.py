"""The offline API on a tiny model, and the embedded SmolLM2 answering a question."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvrelay
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.models import write_tiny_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> kvrelay.LLM:
    path = write_tiny_hf_model(tmp_path_factory.mktemp("llm") / "llama", seed=4)
    # float32: batch independence is asserted token for token.
    return kvrelay.LLM(str(path), dtype="float32", block_size=4, num_blocks=256,
                       max_num_batched_tokens=64)


def test_generate_greedy_is_deterministic_and_batch_independent(llm: kvrelay.LLM) -> None:
    params = kvrelay.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = ["What is the capital of France?", "Hello world", "Once upon a time"]
    together = llm.generate(prompts, params)
    assert [o.prompt for o in together] == prompts
    for prompt, out in zip(prompts, together, strict=True):
        (alone,) = llm.generate(prompt, params)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 10
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert llm.engine.pool.num_in_use == 0  # everything released


def test_stop_string_truncates_and_aborts(llm: kvrelay.LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (full,) = llm.generate("Hello", params)
    text = full.outputs[0].text
    stop = text[3:6]
    assert stop and stop.strip()
    (cut,) = llm.generate(
        "Hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    )
    assert cut.outputs[0].text == text[: text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    assert len(cut.outputs[0].token_ids) < 12
    assert llm.engine.pool.num_in_use == 0


def test_chat_streams_and_token_prompts(llm: kvrelay.LLM) -> None:
    streamed: list[tuple[int, str]] = []
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=8, logprobs=2)
    outs = llm.chat(
        [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]],
        params,
        on_text=lambda i, t: streamed.append((i, t)),
    )
    for i, o in enumerate(outs):
        assert o.prompt is not None and o.prompt.endswith("<|im_start|>assistant\n")
        assert "".join(t for j, t in streamed if j == i) == o.outputs[0].text
        logprobs = o.outputs[0].logprobs
        assert logprobs is not None and len(logprobs) == len(o.outputs[0].token_ids)
        assert all(len(lp.top) == 2 for lp in logprobs)
    (by_ids,) = llm.generate(outs[0].prompt_token_ids, params)
    assert by_ids.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.slow
def test_embedded_smollm2_knows_the_capital_of_france() -> None:
    # Under every --quantization ("What is the capital of France?" hangs on a near tie of
    # its first token, which the default's 8-bit activations flip: kvrelay/demo.py)
    for quantization in ("none", "auto"):
        llm = kvrelay.LLM(num_blocks=64, dtype="float32", quantization=quantization)
        (out,) = llm.chat(
            [{"role": "user", "content": "Name the capital city of France."}],
            SamplingParams(temperature=0.0, max_tokens=16),
        )
        assert "Paris" in out.outputs[0].text, (quantization, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"
        assert llm.model.name == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_embedded_smollm2_answers_under_the_default_quantization() -> None:
    llm = kvrelay.LLM(num_blocks=64, dtype="float32")
    (out,) = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
    )
    assert "4" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_import_kvrelay_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, kvrelay; print('torch' in sys.modules)"
    root = Path(kvrelay.__file__).parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.stdout.strip() == "False"
