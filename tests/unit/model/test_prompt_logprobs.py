"""prompt_logprobs on the real model runner: chunked prefill, batched with other
requests and async scheduling, every prompt token scored once, equal to transformers'
log-softmax in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.runner import TokenLogprobs
from kvrelay.model import load_model
from kvrelay.sampling_params import SamplingParams as SP
from kvrelay.testing.models import write_tiny_hf_model

PROMPT = [5, 17, 42, 99, 7, 7, 23, 61, 88, 3, 140, 201, 9, 250, 31, 77, 12, 5, 17, 42, 6]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("plp") / "llama", seed=6)


def _reference(model_dir: Path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.mark.parametrize(("budget", "async_"), [(2048, False), (7, False), (5, True)])
def test_every_prompt_token_is_scored_once_whatever_the_chunking(
        model_dir: Path, budget: int, async_: bool) -> None:
    ref = _reference(model_dir)
    m = load_model(str(model_dir), dtype="float32", block_size=4, num_blocks=64)
    engine = Engine(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256,
                                    max_num_batched_tokens=budget, async_scheduling=async_),
                    m.runner)
    engine.add_request("other", PROMPT[:9], SP(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("r", PROMPT, SP(temperature=0.0, max_tokens=4, ignore_eos=True,
                                       prompt_logprobs=2))
    got: list[list[TokenLogprobs]] = []
    while engine.has_work():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id == "r"
                got.append(o.prompt_logprobs)
    assert len(got) == 1 and len(got[0]) == len(PROMPT) - 1
    for i, lp in enumerate(got[0], start=1):
        assert lp.logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=1e-4)
        assert lp.rank == int((ref[i - 1] > ref[i - 1, PROMPT[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == ref[i - 1].topk(2).indices.tolist()
