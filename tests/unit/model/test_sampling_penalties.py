"""vLLM's penalties, min_tokens, bad_words and allowed_token_ids in the sampler: each
one changes the logits the way vLLM's sampler does, from the tokens the sampler saw
as inputs of the request's steps."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.runner import ScheduledRequest
from kvrelay.model.sampling.sampler import Sampler
from kvrelay.sampling_params import InvalidParameter
from kvrelay.sampling_params import SamplingParams as SP

VOCAB = 8


def _observe(s: Sampler, rid: str, tokens: list[int], prompt_len: int, p: SP,
             start: int = 0, all_tokens: list[int] | None = None) -> None:
    sr = ScheduledRequest(rid, tokens[start:], start, [], True, p, prompt_len,
                          all_tokens if all_tokens is not None else tokens)
    s.observe([sr], lambda r: r.token_ids)


def _greedy_logits(s: Sampler, logits: torch.Tensor, p: SP, rid: str = "r") -> torch.Tensor:
    """The logits the sampler's greedy argmax sees (logprobs off: in place)."""
    out = logits.clone()
    return s._bias_and_mask(out, [p], [rid])


def test_repetition_divides_positive_and_multiplies_negative_over_prompt_and_output() -> None:
    s = Sampler()
    p = SP(temperature=0.0, repetition_penalty=2.0)
    _observe(s, "r", [1, 2, 3], prompt_len=2, p=p)  # prompt 1, 2; output 3
    logits = torch.tensor([[4.0, 4.0, -4.0, 6.0, 4.0, -4.0, 0.0, 0.0]])
    out = _greedy_logits(s, logits, p)[0].tolist()
    assert out == [4.0, 2.0, -8.0, 3.0, 4.0, -4.0, 0.0, 0.0]


def test_frequency_and_presence_count_output_tokens_only() -> None:
    s = Sampler()
    p = SP(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    _observe(s, "r", [1, 2, 2, 2, 4], prompt_len=2, p=p)  # output 2, 2, 4
    out = _greedy_logits(s, torch.zeros(1, VOCAB), p)[0].tolist()
    assert out == [0.0, 0.0, -2.0, 0.0, -1.5, 0.0, 0.0, 0.0]  # 1 only in the prompt


def test_greedy_choice_changes_with_the_penalty() -> None:
    s = Sampler()
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 4.0, 0.0, 0.0, 0.0]])
    plain, pen = SP(temperature=0.0), SP(temperature=0.0, frequency_penalty=2.0)
    _observe(s, "a", [1, 3], 1, plain)
    _observe(s, "b", [1, 3], 1, pen)
    toks = s.sample(logits.repeat(2, 1), [plain, pen], [2, 2], ["a", "b"])
    assert [t.token_id for t in toks] == [3, 4]


def test_history_is_fed_incrementally_and_from_skipped_positions() -> None:
    """A chunk after a cached prefix reads the skipped tokens from all_token_ids; later
    decode chunks add one token each; re-fed positions (recompute) count once."""
    s = Sampler()
    p = SP(temperature=0.0, frequency_penalty=1.0)
    seq = [5, 6, 7, 7]
    _observe(s, "r", seq[:3], prompt_len=2, p=p, start=2, all_tokens=seq)  # output: 7
    _observe(s, "r", seq, prompt_len=2, p=p, start=3, all_tokens=seq)  # output: 7, 7
    _observe(s, "r", seq, prompt_len=2, p=p, start=0, all_tokens=seq)  # recompute
    out = _greedy_logits(s, torch.zeros(1, VOCAB), p)[0].tolist()
    assert out[7] == -2.0 and out[5] == out[6] == 0.0


def test_prompt_tokens_the_runner_never_computed_still_count_for_repetition() -> None:
    """A decode engine's first chunk starts after the pulled prompt (or a prefix-cache
    hit): the prompt's tokens come from all_token_ids."""
    s = Sampler()
    p = SP(temperature=0.0, repetition_penalty=2.0)
    seq = [5, 6, 1]  # prompt 5, 6 (KV from elsewhere); output 1, the chunk's input
    _observe(s, "r", seq, prompt_len=2, p=p, start=2, all_tokens=seq)
    out = _greedy_logits(s, torch.full((1, VOCAB), 4.0), p)[0].tolist()
    assert out == [4.0, 2.0, 4.0, 4.0, 4.0, 2.0, 2.0, 4.0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    s = Sampler()
    s.rules.eos_token_ids = (0,)
    p = SP(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    logits = torch.tensor([[9.0, 8.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    _observe(s, "r", [4, 5, 3], prompt_len=2, p=p)  # one output token so far
    assert s.sample(logits.clone(), [p], [3], ["r"])[0].token_id == 3
    _observe(s, "r", [4, 5, 3, 3], prompt_len=2, p=p)  # two: EOS allowed again
    assert s.sample(logits.clone(), [p], [4], ["r"])[0].token_id == 0


def test_bad_words_ban_the_last_token_after_its_prefix() -> None:
    s = Sampler()
    p = SP(temperature=0.0, bad_words_token_ids=((6,), (2, 3)))
    _observe(s, "r", [1, 2], prompt_len=1, p=p)  # output ends with 2
    out = _greedy_logits(s, torch.zeros(1, VOCAB), p)[0]
    assert torch.isinf(out[[6, 3]]).all() and torch.isfinite(out[[0, 1, 2, 4, 5, 7]]).all()
    _observe(s, "r", [1, 2, 4], prompt_len=1, p=p)  # prefix broken: 3 allowed again
    out = _greedy_logits(s, torch.zeros(1, VOCAB), p)[0]
    assert torch.isinf(out[6]) and torch.isfinite(out[3])


def test_bad_word_prefix_in_the_prompt_does_not_count() -> None:
    s = Sampler()
    p = SP(temperature=0.0, bad_words_token_ids=((2, 3),))
    _observe(s, "r", [1, 2], prompt_len=2, p=p)  # 2 is a prompt token: no output yet
    assert torch.isfinite(_greedy_logits(s, torch.zeros(1, VOCAB), p)[0]).all()


def test_allowed_token_ids_mask_the_rest_and_sampling_stays_inside() -> None:
    s = Sampler()
    p = SP(temperature=1.0, allowed_token_ids=(2, 5))
    n = 200
    toks = s.sample(torch.randn(n, VOCAB), [p] * n, list(range(n)), [f"r{i}" for i in range(n)])
    assert {t.token_id for t in toks} == {2, 5}


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    s = Sampler()
    p = SP(temperature=0.0, presence_penalty=2.0, logprobs=1)
    _observe(s, "r", [1, 3], 1, p)
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 4.0, 0.0, 0.0, 0.0]])
    tok = s.sample(logits.clone(), [p], [2], ["r"])[0]
    raw = logits.log_softmax(-1)[0]
    assert tok.token_id == 4
    assert tok.logprobs is not None and tok.logprobs.logprob == pytest.approx(float(raw[4]))


def test_requests_without_rules_keep_no_history() -> None:
    s = Sampler()
    _observe(s, "r", [1, 2, 3], 1, SP())
    assert not s.rules._hist
    logits = torch.randn(3, VOCAB)
    assert s._bias_and_mask(logits, [SP()] * 3, []) is logits


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"bad_words_token_ids": ((),)}, "bad_words"),
    ({"allowed_token_ids": ()}, "allowed_token_ids"),
])
def test_out_of_range_names_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameter) as exc:
        SP(**kwargs)  # type: ignore[arg-type]
    assert exc.value.param == param


def test_bench_sampling_prints_each_case_against_the_reference(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay.cli import main

    assert main(["bench", "sampling", "--batch", "4", "--prompt", "8", "--output", "8",
                 "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("none (reference)", "frequency+presence", "repetition", "min_tokens",
                 "bad_words", "allowed_token_ids"):
        assert name in out, out
