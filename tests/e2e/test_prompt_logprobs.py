"""Prompt logprobs as lm-evaluation-harness asks for them (completions with echo,
logprobs and max_tokens 1 or 0) and vLLM's prompt_logprobs, colocated and 1P1D through
the proxy, against transformers' log-softmax of the same checkpoint in float32."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Proc, colocated_and_pd, metric, pools_free
from tests.metrics_util import metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = [5, 17, 42, 99, 7, 7, 23, 61, 88, 3, 140, 201, 9, 250, 31, 77, 12, 5, 17, 42]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[float]:
    """transformers' logprob of prompt token i given tokens < i, i >= 1."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    with colocated_and_pd(model_dir, tmp_path_factory.mktemp("prompt-logprobs-logs")) as (_, procs):
        yield procs


def _complete(proc: Proc, model: str, **kw: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "temperature": 0, **kw}
    r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("where", ["colo", "proxy"])
@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_scores_the_prompt_as_transformers(
        cluster: dict[str, Proc], model_dir: Path, reference: list[float], where: str,
        max_tokens: int) -> None:
    # Twice: the second request's prompt is in the prefix cache, which it must skip.
    for _ in range(2):
        out = _complete(cluster[where], model_dir.name, echo=True, logprobs=1,
                        max_tokens=max_tokens)
        choice, lp = out["choices"][0], out["choices"][0]["logprobs"]
        n = len(PROMPT) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(PROMPT)] == pytest.approx(reference, abs=1e-4)
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert out["usage"]["completion_tokens"] == max_tokens
        assert out["usage"]["prompt_tokens"] == len(PROMPT)
        assert choice["text"].startswith("".join(lp["tokens"][:len(PROMPT)]))
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=10)


@pytest.mark.parametrize("where", ["colo", "proxy"])
def test_vllm_prompt_logprobs(cluster: dict[str, Proc], model_dir: Path,
                              reference: list[float], where: str) -> None:
    out = _complete(cluster[where], model_dir.name, max_tokens=2, prompt_logprobs=3)
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        mine = entry[str(PROMPT[i])]
        assert mine["logprob"] == pytest.approx(reference[i - 1], abs=1e-4)
        assert mine["rank"] >= 1 and mine["decoded_token"] is not None
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(PROMPT[i]))
        assert len(entry) in (3, 4) and ranks[:3] == [1, 2, 3][:len(ranks)]
    assert out["usage"]["completion_tokens"] == 2


def _same(out: dict[str, Any]) -> dict[str, Any]:
    """An answer less what differs between any two answers (id, created)."""
    return {k: v for k, v in out.items() if k not in ("id", "created")}


def assert_close(got: Any, want: Any, where: str = "answer") -> None:
    """Equal, but for logprobs within 1e-4 (engines batch differently: the last bits of
    a float may differ, the tokens and texts may not)."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict) and isinstance(got, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _disaggregated(proxy: Proc) -> float:
    return metric(metrics(proxy.url), 'kvrelay_proxy_requests_total{path="disaggregated"}')


# echo scores the prompt on P (which ran every position) and D samples tokens 2..n.
SPLIT_CASES: list[dict[str, Any]] = [
    {"echo": True, "logprobs": 2, "max_tokens": 5},
    {"echo": True, "logprobs": 1, "max_tokens": 0},
    {"echo": True, "max_tokens": 4},
    {"prompt_logprobs": 3, "logprobs": 1, "max_tokens": 4},
    {"echo": True, "logprobs": 0, "prompt_logprobs": 2, "max_tokens": 3, "n": 2,
     "temperature": 1.0, "seed": 7},
    {"echo": True, "logprobs": 1, "max_tokens": 3, "prompt": [PROMPT, PROMPT[:9]]},
]


@pytest.mark.parametrize("kw", SPLIT_CASES, ids=lambda kw: "-".join(f"{k}{v}" for k, v in
                                                                  kw.items() if k != "prompt"))
def test_prefill_engine_scores_the_prompt_as_colocated(
        cluster: dict[str, Proc], model_dir: Path, kw: dict[str, Any]) -> None:
    before = _disaggregated(cluster["proxy"])
    colo = _complete(cluster["colo"], model_dir.name, **kw)
    split = _complete(cluster["proxy"], model_dir.name, **kw)
    assert_close(_same(split), _same(colo))
    legs = len(colo["choices"])
    # Every choice went through P (its first token and the prompt's scores are P's).
    assert _disaggregated(cluster["proxy"]) - before == legs
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=10)


def _stream(proc: Proc, model: str, **kw: Any) -> list[dict[str, Any]]:
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **kw}
    chunks = []
    with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(_same(json.loads(line[6:])))
    return chunks


@pytest.mark.parametrize("max_tokens", [4, 0])
def test_streamed_echo_is_the_prompt_first_as_colocated(
        cluster: dict[str, Proc], model_dir: Path, reference: list[float],
        max_tokens: int) -> None:
    colo = _stream(cluster["colo"], model_dir.name, echo=True, logprobs=1,
                   max_tokens=max_tokens)
    split = _stream(cluster["proxy"], model_dir.name, echo=True, logprobs=1,
                    max_tokens=max_tokens)
    assert_close(split, colo)
    # vLLM's layout: the first chunk is the prompt (with its logprobs, the first null)
    # and the first token; then one chunk per token; then the usage.
    first = colo[0]["choices"][0]
    n_first = len(PROMPT) + min(max_tokens, 1)
    assert len(first["logprobs"]["tokens"]) == n_first
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][1:len(PROMPT)] == pytest.approx(reference,
                                                                               abs=1e-4)
    assert len(colo) == 1 + max(max_tokens - 1, 0) + 1
    assert colo[-1]["usage"]["completion_tokens"] == max_tokens
    offsets = [o for c in colo if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and len(offsets) == len(PROMPT) + max_tokens
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=10)


def test_refused_where_it_cannot_be_served(cluster: dict[str, Proc], model_dir: Path) -> None:
    r = httpx.post(cluster["colo"].url + "/v1/completions", timeout=30, json={
        "model": model_dir.name, "prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = httpx.post(cluster["colo"].url + "/v1/completions", timeout=30, json={
        "model": model_dir.name, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # A decode engine that pulls the prompt's KV never computed its positions.
    r = httpx.post(cluster["d"].url + "/v1/completions", timeout=30, json={
        "model": model_dir.name, "prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs_as_transformers_colocated_and_split(
        cluster: dict[str, Proc], model_dir: Path) -> None:
    """vLLM's chat prompt_logprobs (top level): the templated prompt scored, by P on 1P1D."""
    import torch
    import transformers

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    body = {"model": model_dir.name, "messages": messages, "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 1, "logprobs": True}
    before = _disaggregated(cluster["proxy"])
    answers = {}
    for where in ("colo", "proxy"):
        r = httpx.post(cluster[where].url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answers[where] = r.json()
        plp = answers[where]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            assert plp[i][str(ids[i])]["logprob"] == pytest.approx(float(lp[i - 1, ids[i]]),
                                                                   abs=1e-4)
    assert_close(_same(answers["proxy"]), _same(answers["colo"]))
    assert _disaggregated(cluster["proxy"]) - before == 1
    pools_free(cluster["d"], prefill=(cluster["p"],), timeout=10)
