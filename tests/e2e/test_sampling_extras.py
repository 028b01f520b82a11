"""vLLM's sampling parameters (penalties, min_tokens, bad_words, allowed_token_ids)
change the output of a real served model, colocated and 1P1D through the proxy, and
both give the same answer (P and D each apply them: D with the prompt and the tokens
so far in its history)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvrelay.model.llm import LLM
from kvrelay.sampling_params import SamplingParams
from tests.e2e.cluster import Proc, ask, colocated_and_pd, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [5, 17, 42, 99, 7, 7, 23, 61, 88, 3, 140, 201]
MAX = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def base(model_dir: Path) -> list[int]:
    """The greedy output without any of the parameters (the offline engine)."""
    llm = LLM(str(model_dir), dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=MAX, temperature=0.0,
                                                ignore_eos=True))
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    with colocated_and_pd(model_dir, tmp_path_factory.mktemp("sampling-extras-logs")) as (_, procs):
        yield procs


def _client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _tokens(c: openai.OpenAI, model: str, extra: dict[str, Any]) -> tuple[list[str], int, str]:
    """(token texts, completion tokens, finish reason) of a greedy completion."""
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=MAX, temperature=0.0,
                             logprobs=0, extra_body=extra)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and r.usage is not None
    return lp.tokens, r.usage.completion_tokens, r.choices[0].finish_reason or ""


def _same_through_the_proxy(cluster: dict[str, Proc], model: str, extra: dict[str, Any],
                            prompt: list[int] = PROMPT) -> tuple[str, int, str]:
    kw = {"model": model, "prompt": prompt, "max_tokens": MAX, "temperature": 0.0,
          "extra_body": extra}
    want = ask(_client(cluster["colo"]), "completion", False, kw)
    for stream in (False, True):
        assert ask(_client(cluster["proxy"]), "completion", stream, kw) == want, (extra, stream)
    return want


@pytest.mark.parametrize("extra", [
    {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8},
    {"frequency_penalty": -1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3},
])
def test_penalties_change_the_output_the_same_way_colocated_and_1p1d(
        cluster: dict[str, Proc], model_dir: Path, extra: dict[str, Any]) -> None:
    plain = _same_through_the_proxy(cluster, model_dir.name, {"ignore_eos": True})
    penalized = _same_through_the_proxy(cluster, model_dir.name, {"ignore_eos": True, **extra})
    assert penalized[0] != plain[0]


def test_repetition_penalty_counts_the_prompt_on_the_decode_engine(
        cluster: dict[str, Proc], model_dir: Path, base: list[int]) -> None:
    """The prompt holds the tokens the model would generate next: only a penalty that
    knows the prompt (D reads it from the request; it never computed it) changes them."""
    prompt = PROMPT + base[:12]
    extra = {"ignore_eos": True, "repetition_penalty": 2.0}
    plain = _same_through_the_proxy(cluster, model_dir.name, {"ignore_eos": True}, prompt)
    penalized = _same_through_the_proxy(cluster, model_dir.name, extra, prompt)
    assert penalized[0] != plain[0]


@pytest.mark.parametrize("stop_at", [0, 2])  # 0: P samples the stop token; 2: D does
def test_min_tokens_holds_back_stop_token_ids(
        cluster: dict[str, Proc], model_dir: Path, base: list[int], stop_at: int) -> None:
    stop = {"stop_token_ids": [base[stop_at]]}
    assert base[stop_at] not in base[:stop_at]
    _, n_plain, finish = _same_through_the_proxy(cluster, model_dir.name, stop)
    assert (n_plain, finish) == (stop_at + 1, "stop")
    _, n_min, _ = _same_through_the_proxy(cluster, model_dir.name, {**stop, "min_tokens": 6})
    assert n_min >= 6


def test_min_tokens_defers_stop_strings(cluster: dict[str, Proc], model_dir: Path) -> None:
    c, name = _client(cluster["colo"]), model_dir.name
    plain, _, _ = _tokens(c, name, {"ignore_eos": True})
    word = next(w for t in plain if (w := t.strip()).isascii() and w.isalpha())
    stop = {"stop": [word], "ignore_eos": True}
    text, n_plain, finish = _same_through_the_proxy(cluster, name, stop)
    assert finish == "stop" and word not in text
    min_tokens = n_plain + 2
    text, n_min, _ = _same_through_the_proxy(cluster, name, {**stop, "min_tokens": min_tokens})
    assert n_min > min_tokens and word in text


def test_bad_words_are_never_generated(
        cluster: dict[str, Proc], model_dir: Path, base: list[int]) -> None:
    c, name = _client(cluster["colo"]), model_dir.name
    plain, _, _ = _tokens(c, name, {"ignore_eos": True})
    # vLLM bans a word's in-text form (" word") only where it has as many tokens as the
    # word alone: pick one of the output's words for which both are one token.
    tok = LLM(str(model_dir), dtype="float32").tokenizer
    word = next(w for t in plain if (w := t.strip()).isascii() and w.isalpha()
                and len(tok.encode(w, add_special_tokens=False)) == 1
                and len(tok.encode(" " + w, add_special_tokens=False)) == 1)
    extra = {"ignore_eos": True, "bad_words": [word]}
    banned, _, _ = _tokens(c, name, extra)
    assert not any(t.strip() == word for t in banned), (word, banned)
    _same_through_the_proxy(cluster, name, extra)


def test_allowed_token_ids_bound_the_output(
        cluster: dict[str, Proc], model_dir: Path, base: list[int]) -> None:
    allowed = [t for t in range(260, 400) if t not in base][:2]
    extra = {"ignore_eos": True, "allowed_token_ids": allowed}
    c, name = _client(cluster["colo"]), model_dir.name
    texts, n, _ = _tokens(c, name, extra)
    plain, _, _ = _tokens(c, name, {"ignore_eos": True})
    tok = LLM(str(model_dir), dtype="float32").tokenizer
    allowed_texts = {tok.decode([t], skip_special_tokens=False) for t in allowed}
    assert n == MAX and set(texts) <= allowed_texts and not set(plain) <= allowed_texts
    _same_through_the_proxy(cluster, name, extra)
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=10)
