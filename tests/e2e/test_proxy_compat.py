"""The proxy answers like one server; vLLM's way of driving P and D works; metrics.

One module-scoped cluster of real processes on the tiny model: a colocated engine (the
reference), a prefill engine, a decode engine (shm), kvrelay's proxy in front of them,
and a second proxy whose engines are all down. The official ``openai`` client, or raw
httpx where the client would hide what is checked (status codes, SSE lines), compares
what the proxy answers with what the colocated engine answers to the same request.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.cluster import (
    REPO,
    Proc,
    colocated_and_pd,
    env,
    free_port,
    pools_free,
    sample,
)
from tests.metrics_util import metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPTS = ["The quick brown fox", "Once upon a time there lived a"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    with colocated_and_pd(model_dir, tmp_path_factory.mktemp("proxy-compat-logs")) as (c, procs):
        dead = [Proc("nobody", [], c.logdir / "unused.log") for _ in range(2)]
        procs["dead"] = c.proxy([dead[0]], [dead[1]], "proxy-dead")
        _wait_up(procs["dead"].url + "/metrics")
        yield procs


def _wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not up"
        time.sleep(0.1)


def client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=30)


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=2e-3)
                                    for x, y in zip(a, b, strict=True))


# -- batches, n, logprobs, one id and one role ------------------------------------------
def collect_completion_stream(proc: Proc, kw: dict[str, Any]) -> dict[str, Any]:
    ids, texts, lps, finish, usage = set(), {}, {}, {}, None
    for ch in client(proc).completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True}):
        ids.add(ch.id)
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lp = lps.setdefault(c.index, {"tokens": [], "token_logprobs": [],
                                              "text_offset": []})
                for k in lp:
                    lp[k] += getattr(c.logprobs, k)
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert usage is not None
    return {"ids": ids, "texts": texts, "logprobs": lps, "finish": finish,
            "usage": (usage.prompt_tokens, usage.completion_tokens)}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_batch_with_n_and_logprobs_equals_colocated(cluster: dict[str, Proc], model_dir: Path,
                                                    stream: bool) -> None:
    """Two prompts x n=2 (seeded sampling), logprobs: the proxy splits them into four P/D
    requests and answers exactly what the colocated engine answers, indices included."""
    kw = {"model": model_dir.name, "prompt": PROMPTS, "n": 2, "max_tokens": 6, "seed": 11,
          "temperature": 0.9, "logprobs": 1}
    if stream:
        want, got = (collect_completion_stream(cluster[k], kw) for k in ("colo", "proxy"))
        assert len(got["ids"]) == 1, got["ids"]
        assert got["texts"] == want["texts"] and sorted(got["texts"]) == [0, 1, 2, 3]
        assert got["finish"] == want["finish"] and got["usage"] == want["usage"]
        for i, lp in want["logprobs"].items():
            assert got["logprobs"][i]["tokens"] == lp["tokens"]
            assert got["logprobs"][i]["text_offset"] == lp["text_offset"]
            assert close(got["logprobs"][i]["token_logprobs"], lp["token_logprobs"])
            assert len(lp["tokens"]) == 6
    else:
        w, g = (client(cluster[k]).completions.create(**kw) for k in ("colo", "proxy"))
        assert [c.index for c in g.choices] == [0, 1, 2, 3]
        assert [c.text for c in g.choices] == [c.text for c in w.choices]
        assert [c.finish_reason for c in g.choices] == [c.finish_reason for c in w.choices]
        assert (g.usage.prompt_tokens, g.usage.completion_tokens) == (
            w.usage.prompt_tokens, w.usage.completion_tokens)
        for gc, wc in zip(g.choices, w.choices, strict=True):
            assert gc.logprobs is not None and wc.logprobs is not None
            assert gc.logprobs.tokens == wc.logprobs.tokens and len(wc.logprobs.tokens) == 6
            assert gc.logprobs.text_offset == wc.logprobs.text_offset
            assert close(gc.logprobs.token_logprobs, wc.logprobs.token_logprobs)
    pools_free(cluster["d"], prefill=(cluster["p"],))


def test_chat_stream_one_id_one_role_per_choice(cluster: dict[str, Proc], model_dir: Path) -> None:
    kw: dict[str, Any] = {"model": model_dir.name, "max_tokens": 5, "seed": 3, "n": 2,
                          "temperature": 0.8,
                          "messages": [{"role": "user", "content": "Name a colour."}]}
    want = client(cluster["colo"]).chat.completions.create(**kw)
    ids, roles, texts = set(), {0: 0, 1: 0}, {0: "", 1: ""}
    for ch in client(cluster["proxy"]).chat.completions.create(**kw, stream=True):
        ids.add(ch.id)
        assert ch.object == "chat.completion.chunk"
        for c in ch.choices:
            roles[c.index] += c.delta.role is not None
            texts[c.index] += c.delta.content or ""
    assert len(ids) == 1 and roles == {0: 1, 1: 1}, (ids, roles)
    assert texts == {c.index: c.message.content for c in want.choices}
    # The openai stream helper accumulates the deltas: one role, the whole text.
    kw.update(n=1)
    with client(cluster["proxy"]).chat.completions.stream(**kw) as s:
        try:
            final: Any = s.get_final_completion()
        except openai.LengthFinishReasonError as exc:  # it parses only "stop" answers
            final = exc.completion
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].message.content == \
        client(cluster["colo"]).chat.completions.create(**kw).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_logprobs_cover_the_first_token(cluster: dict[str, Proc], model_dir: Path,
                                             stream: bool) -> None:
    kw: dict[str, Any] = {"model": model_dir.name, "max_tokens": 4, "temperature": 0,
                          "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True},
                          "messages": [{"role": "user", "content": "Count to three."}]}
    out = {}
    for name in ("colo", "proxy"):
        c = client(cluster[name])
        if stream:
            entries = [e for ch in c.chat.completions.create(**kw, stream=True)
                       for choice in ch.choices if choice.logprobs
                       for e in choice.logprobs.content or []]
        else:
            lp = c.chat.completions.create(**kw).choices[0].logprobs
            assert lp is not None
            entries = list(lp.content or [])
        out[name] = entries
    assert len(out["proxy"]) == len(out["colo"]) == 4
    assert [e.token for e in out["proxy"]] == [e.token for e in out["colo"]]
    assert close([e.logprob for e in out["proxy"]], [e.logprob for e in out["colo"]])
    assert [len(e.top_logprobs) for e in out["proxy"]] == [2] * 4


# -- errors ----------------------------------------------------------------------------------
def bad_bodies(model: str) -> list[tuple[str, bytes]]:
    def b(text: str) -> bytes:
        return text.replace("MODEL", model).encode()

    return [
        ("nan", b('{"model": "MODEL", "prompt": "hi", "temperature": NaN}')),
        ("infinity", b('{"model": "MODEL", "prompt": "hi", "top_p": Infinity}')),
        ("unknown field nan", b('{"model": "MODEL", "prompt": "hi", "extra": -Infinity}')),
        ("lone surrogate", b('{"model": "MODEL", "prompt": "a\\ud800b"}')),
        ("lone surrogate chat", b('{"model": "MODEL", "messages": '
                                  '[{"role": "user", "content": "\\udc00"}]}')),
        ("deep nesting", b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("not json", b"{nope"),
        ("array", b"[1, 2]"),
        ("empty batch item", b('{"model": "MODEL", "prompt": ["ok", ""]}')),
        ("n zero", b('{"model": "MODEL", "prompt": "hi", "n": 0}')),
        ("unknown model", b'{"model": "nope", "prompt": "hi"}'),
        ("prompt too long", b('{"model": "MODEL", "prompt": "' + "hi " * 2000 + '"}')),
    ]


@pytest.mark.parametrize("case", range(12))
def test_errors_are_openai_json_like_serve(cluster: dict[str, Proc], model_dir: Path,
                                           case: int) -> None:
    name, raw = bad_bodies(model_dir.name)[case]
    path = "/v1/chat/completions" if "chat" in name else "/v1/completions"
    got = {}
    for proc in ("colo", "proxy"):
        r = httpx.post(cluster[proc].url + path, content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        got[proc] = (r.status_code, err["param"])
    assert got["proxy"] == got["colo"], (name, got)
    assert 400 <= got["proxy"][0] < 500, (name, got)


def test_models_through_the_proxy(cluster: dict[str, Proc], model_dir: Path) -> None:
    assert [m.id for m in client(cluster["proxy"]).models.list().data] == [model_dir.name]


def test_framework_errors_are_openai_json(cluster: dict[str, Proc]) -> None:
    for r in (httpx.get(cluster["proxy"].url + "/v1/nothing"),
              httpx.get(cluster["proxy"].url + "/v1/completions")):
        assert r.status_code in (404, 405) and r.json()["error"]["message"], r.text


def test_no_engine_up(cluster: dict[str, Proc], model_dir: Path) -> None:
    url = cluster["dead"].url
    r = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"], r.text
    body = {"model": model_dir.name, "prompt": "hi", "max_tokens": 3}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code >= 500 and r.json()["error"]["message"], r.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events


# -- vLLM interop ------------------------------------------------------------------------
VLLM_P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def vllm_flow(cluster: dict[str, Proc], path: str, body: dict[str, Any]) -> httpx.Response:
    """What vLLM's disaggregation proxy does: P with its params, max_tokens 1, not
    streamed; P's answer thrown away but for kv_transfer_params, passed to D unchanged
    with the client's request (so D must send the first token itself)."""
    p_body = {**body, "kv_transfer_params": VLLM_P_PARAMS, "stream": False, "max_tokens": 1}
    p_body.pop("stream_options", None)
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    r = httpx.post(cluster["p"].url + path, json=p_body, timeout=30)
    assert r.status_code == 200, r.text
    params = r.json().get("kv_transfer_params")
    assert params and "first_token_sent" not in params, params
    return httpx.post(cluster["d"].url + path, json={**body, "kv_transfer_params": params},
                      timeout=30)


def sse_text(raw: str, chat: bool) -> str:
    out = ""
    for line in raw.splitlines():
        if line.startswith("data:") and "[DONE]" not in line:
            for c in json.loads(line[5:])["choices"]:
                out += (c["delta"].get("content") or "") if chat else c["text"]
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_vllm_proxy_flow_loses_no_token(cluster: dict[str, Proc], model_dir: Path,
                                        chat: bool, stream: bool) -> None:
    body: dict[str, Any] = {"model": model_dir.name, "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Hi"}]
    else:
        path, body["prompt"] = "/v1/completions", PROMPTS[0]
    want = httpx.post(cluster["colo"].url + path, json={**body, "stream": False}, timeout=30)
    w = want.json()["choices"][0]
    want_text = w["message"]["content"] if chat else w["text"]
    r = vllm_flow(cluster, path, body)
    assert r.status_code == 200, r.text
    if stream:
        got = sse_text(r.text, chat)
    else:
        g = r.json()["choices"][0]
        got = g["message"]["content"] if chat else g["text"]
        assert r.json()["usage"]["completion_tokens"] == 6
    assert got == want_text
    pools_free(cluster["d"], prefill=(cluster["p"],))


def test_vllm_nixl_params_are_refused_naming_the_fields(cluster: dict[str, Proc],
                                                        model_dir: Path) -> None:
    nixl = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e0",
            "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1}
    r = httpx.post(cluster["d"].url + "/v1/completions", timeout=30, json={
        "model": model_dir.name, "prompt": "hi", "max_tokens": 3, "kv_transfer_params": nixl})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params"
    for field in ("lease_id", "relay", "engine_id", "block_ids", "num_tokens", "first_token",
                  "compat"):
        assert field in err["message"], err["message"]
    assert "NixlConnector" in err["message"]


TOY_PROXY = os.environ.get("KVRELAY_VLLM_TOY_PROXY", "")


@pytest.mark.skipif(not TOY_PROXY, reason="set KVRELAY_VLLM_TOY_PROXY to the path of vLLM's "
                    "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (not shipped "
                    "here: another project's code stays out of this repository)")
def test_vllm_toy_proxy_unchanged(cluster: dict[str, Proc], model_dir: Path,
                                  tmp_path: Path) -> None:
    """vLLM's own disaggregation proxy, run as it is, in front of kvrelay's P and D."""
    port = free_port()
    hp = lambda proc: ["127.0.0.1", str(proc.port)]  # noqa: E731
    cmd = [sys.executable, TOY_PROXY, "--port", str(port), "--prefiller-host",
           hp(cluster["p"])[0], "--prefiller-port", hp(cluster["p"])[1],
           "--decoder-host", hp(cluster["d"])[0], "--decoder-port", hp(cluster["d"])[1]]
    with open(tmp_path / "toy.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_up(f"http://127.0.0.1:{port}/healthcheck")
        toy = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                            max_retries=0, timeout=30)
        colo = client(cluster["colo"])
        kw: dict[str, Any] = {"model": model_dir.name, "max_tokens": 6, "temperature": 0,
                              "extra_body": {"ignore_eos": True}}
        msgs = [{"role": "user", "content": "Hello there"}]
        assert toy.completions.create(prompt=PROMPTS[1], **kw).choices[0].text == \
            colo.completions.create(prompt=PROMPTS[1], **kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in toy.completions.create(
            prompt=PROMPTS[0], stream=True, **kw) if c.choices)
        assert streamed == colo.completions.create(prompt=PROMPTS[0], **kw).choices[0].text
        assert toy.chat.completions.create(messages=msgs, **kw).choices[0].message.content == \
            colo.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        pools_free(cluster["d"], prefill=(cluster["p"],))
    finally:
        proc.kill()
        proc.wait(10)


# -- metrics -----------------------------------------------------------------------------
KINDS = {"colo": "colocated", "p": "P", "d": "D", "proxy": "proxy"}


def documented_metrics() -> dict[str, set[str]]:
    """docs/operations.md's metric table: name -> the kinds of process that export it."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {k: set() for k in KINDS.values()}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith(("`kvrelay_", "`vllm:")):
            continue
        name = re.sub(r"\{.*", "", cells[0].strip("`"))
        where = {w.strip() for w in cells[2].split(",")}
        if "engines" in where:
            where |= {"colocated", "P", "D"}
        for kind in where & set(out):
            out[kind].add(name)
    return out


def exported_metrics(url: str) -> set[str]:
    """Metric names as ``# TYPE`` lines give them (counters with _total, histograms by
    family): every family, with samples yet or not."""
    return {line.split()[2] for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("# TYPE ")}


def test_documented_metrics_are_the_exported_ones(cluster: dict[str, Proc]) -> None:
    docs = documented_metrics()
    assert all(docs.values()), docs
    for proc, kind in KINDS.items():
        exported = exported_metrics(cluster[proc].url)
        assert exported - docs[kind] == set(), f"{kind}: exported but not in operations.md"
        assert docs[kind] - exported == set(), f"{kind}: in operations.md but not exported"


def test_each_request_counted_once_across_p_and_d(cluster: dict[str, Proc],
                                                  model_dir: Path) -> None:
    p, d = cluster["p"], cluster["d"]
    before = {k: metrics(cluster[k].url) for k in ("p", "d")}
    r = client(cluster["proxy"]).completions.create(
        model=model_dir.name, prompt=PROMPTS[1], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True})
    assert r.usage is not None
    pools_free(d, prefill=(p,))
    after = {k: metrics(cluster[k].url) for k in ("p", "d")}

    def delta(k: str, name: str) -> float:
        return sample(after[k], name) - sample(before[k], name)

    assert delta("p", "kvrelay_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("d", "kvrelay_prompt_tokens_total") == 0
    assert delta("p", "kvrelay_request_prompt_tokens_count") == 1
    assert delta("d", "kvrelay_request_prompt_tokens_count") == 0
    assert (delta("p", "kvrelay_generation_tokens_total")
            + delta("d", "kvrelay_generation_tokens_total")) == r.usage.completion_tokens == 5
    assert delta("d", "kvrelay_request_generation_tokens_count") == 1
    assert delta("d", "kvrelay_request_generation_tokens_sum") == 5
    assert delta("p", "kvrelay_request_generation_tokens_count") == 0
    assert delta("p", "kvrelay_request_queue_time_seconds_count") == 1
    assert delta("d", "kvrelay_request_queue_time_seconds_count") == 1
    for k in ("p", "d"):  # the engine's series and the relay's
        unlabelled = [s for s in after[k] if s.startswith("kvrelay_")
                      and f'model_name="{model_dir.name}"' not in s]
        assert unlabelled == [], unlabelled


def test_health_polls_are_not_logged_at_info(cluster: dict[str, Proc]) -> None:
    """The proxy polls /health every 0.5 s here; at --log-level info none of it shows."""
    time.sleep(1.5)
    log = cluster["proxy"].log.read_text(errors="replace")
    assert "proxy on http" in log
    assert [line for line in log.splitlines() if "/health" in line] == []
