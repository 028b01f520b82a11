"""Sampling: greedy, temperature, top-k/top-p/min-p, seeds, logprobs; seeded tokens
do not depend on the batch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.model import load_model
from kvrelay.model.sampling.sampler import Sampler, process_logits
from kvrelay.sampling_params import SamplingParams as SP
from kvrelay.testing.models import write_tiny_hf_model

SEEDS = {"r0": 7, "r1": 8, "r2": 7, "r3": 9}
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def _draws(params: SP, n: int = 400) -> Counter[int]:
    s = Sampler(seed=0)
    logits = LOGITS.repeat(n, 1)
    return Counter(t.token_id for t in s.sample(logits, [params] * n, list(range(n))))


def test_greedy_is_argmax_for_the_whole_batch() -> None:
    logits = torch.randn(7, 50)
    toks = Sampler().sample(logits, [SP(temperature=0.0)] * 7, [0] * 7)
    assert [t.token_id for t in toks] == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_maximum_on_ties_and_nan_as_argmax_does() -> None:
    # whole-number logits in a small range: many rows hold their maximum twice or more
    logits = torch.randint(-2, 2, (64, 1000), generator=torch.Generator().manual_seed(0)).float()
    logits[3, 17] = float("nan")
    logits[5] = float("-inf")
    toks = [t.token_id for t in Sampler().sample(logits, [SP(temperature=0.0)] * 64, [0] * 64)]
    assert toks == logits.argmax(-1).tolist()
    assert toks[3] == 17 and toks[5] == 0
    rows = [i for i in range(64) if i != 3]
    first_max = [int((logits[i] == logits[i].max()).nonzero()[0]) for i in rows]
    assert [toks[i] for i in rows] == first_max


def test_temperature_sampling_follows_softmax() -> None:
    counts = _draws(SP(temperature=1.0), n=4000)
    probs = LOGITS.softmax(-1)[0]
    for tok, p in enumerate(probs.tolist()):
        assert abs(counts[tok] / 4000 - p) < 0.03


def test_filters_restrict_the_support() -> None:
    assert set(_draws(SP(top_k=2))) == {0, 1}
    assert set(_draws(SP(top_k=1))) == {0}
    assert set(_draws(SP(top_p=0.5))) == {0}  # p(0) = 0.57 covers 0.5 alone
    assert set(_draws(SP(top_p=0.75))) == {0, 1}  # 0.56 + 0.21 reaches 0.75
    assert set(_draws(SP(min_p=0.3))) == {0, 1}  # p(2)/p(0) = 0.22
    assert set(_draws(SP(temperature=0.1))) == {0}


def test_process_logits_masks_per_row() -> None:
    logits = LOGITS.repeat(2, 1)
    out = process_logits(logits, [SP(top_k=3), SP(top_p=1.0)])
    assert torch.isinf(out[0, 3:]).all() and torch.isfinite(out[0, :3]).all()
    assert torch.isfinite(out[1]).all()


def test_seeded_token_depends_only_on_seed_position_and_logits() -> None:
    logits = torch.randn(1, 1000)
    p = SP(temperature=1.0, seed=42)
    alone = Sampler(seed=1).sample(logits, [p], [17])[0].token_id
    others = torch.randn(5, 1000)
    batch = torch.cat([others[:3], logits, others[3:]])
    params = [SP(temperature=0.7), SP(temperature=0.0), SP(seed=3), p, SP(top_k=5), SP()]
    mixed = Sampler(seed=2).sample(batch, params, [1, 2, 3, 17, 5, 6])
    assert mixed[3].token_id == alone
    # Other positions draw other noise.
    draws = {Sampler().sample(logits, [p], [pos])[0].token_id for pos in range(30)}
    assert len(draws) > 10


def test_logprobs_top_n() -> None:
    s = Sampler()
    toks = s.sample(LOGITS.repeat(2, 1), [SP(temperature=0.0, logprobs=3), SP(logprobs=0)], [0, 0])
    lp = LOGITS.log_softmax(-1)[0]
    assert toks[0].logprobs is not None and toks[1].logprobs is not None
    assert toks[0].logprobs.logprob == pytest.approx(float(lp[0]))
    assert [t for t, _ in toks[0].logprobs.top] == [0, 1, 2]
    assert [v for _, v in toks[0].logprobs.top] == pytest.approx(lp[:3].tolist())
    assert toks[1].logprobs.top == []
    assert toks[1].logprobs.logprob == pytest.approx(float(lp[toks[1].token_id]))
    assert s.sample(LOGITS, [SP()], [0])[0].logprobs is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("s") / "qwen2", arch="qwen2", seed=5)


def _run(model_dir: Path, prompts: dict[str, list[int]], budget: int, async_: bool) -> dict:
    m = load_model(str(model_dir), block_size=4, num_blocks=128)
    cfg = SchedulerConfig(
        num_blocks=128,
        block_size=4,
        max_model_len=512,
        max_num_batched_tokens=budget,
        async_scheduling=async_,
    )
    engine = Engine(cfg, m.runner)
    for rid, prompt in prompts.items():
        params = SP(temperature=0.9, top_p=0.95, seed=SEEDS[rid], max_tokens=20, ignore_eos=True)
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_seeded_sampling_is_identical_across_engines_and_batches(model_dir: Path) -> None:
    prompts = {f"r{i}": [3 + (i * 11 + j) % 350 for j in range(5 + 7 * i)] for i in range(4)}
    together = _run(model_dir, prompts, budget=10, async_=True)
    for rid, prompt in prompts.items():
        alone = _run(model_dir, {rid: prompt}, budget=512, async_=False)
        assert alone[rid] == together[rid]
    # r0 and r2 share a seed but not a prompt; r0 and r1 differ in both.
    assert len({tuple(t) for t in together.values()}) == 4
