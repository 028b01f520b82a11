"""vllm-router (the Rust router on the package index) in front of kvrelay engines, as an
operator who already runs it would put it: ``vllm-router --vllm-pd-disaggregation
--prefill P --decode D``. Its default P/D mode (0.1.17) is ``--kv-connector nixl``: it
sends P the client's body with ``max_tokens: 1``, ``min_tokens: 1``, ``stream: false``
and ``kv_transfer_params: {do_remote_decode: true, ...}``, then D the client's body with
P's ``kv_transfer_params`` verbatim, so D pulls the KV. Also the request shape of llm-d's
decode sidecar in its ``nixlv2`` mode, driven by a test client. docs/deploy.md, "Fronts",
says what each front gives and what these tests found.

Real processes on loopback: the router binary, kvrelay engines on the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.cluster import (
    Cluster,
    ask,
    metric,
    metrics,
    poll,
    pools_free,
    write_fat_model,
)
from tests.e2e.router import ROUTER, Router

if ROUTER is None and os.environ.get("KVRELAY_REQUIRE_VLLM") == "1":  # make test
    raise RuntimeError("vllm-router is not installed: the dev extra installs it")
if ROUTER is None:
    pytest.skip("vllm-router is not installed (the dev extra installs it)",
                allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

KEY = "router-test-key"
PROMPTS = (
    "The quick brown fox",
    "Once upon a time in a land far away there lived",
    "A much longer prompt that spans several KV blocks of four tokens each, so that the "
    "transfer moves more than one block and the last block is partial.",
)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def rig(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A colocated engine, P and D (tcp), every one with --api-key, and the router in its
    default P/D mode in front of P and D. The router authenticates to the engines with
    the key in its environment's OPENAI_API_KEY (its --api-key is for data-parallel
    routing), in place of the client's header."""
    logs = tmp_path_factory.mktemp("router-logs")
    c = Cluster(model_dir, logs)
    router = None
    try:
        key = ("--api-key", KEY)
        procs = {"colo": c.colocated("colo", *key), "p": c.prefill("prefill", *key),
                 "d": c.decode("decode", "tcp", *key)}
        for p in procs.values():
            p.wait_healthy()
        router = Router(logs / "router.log", [procs["p"].url], [procs["d"].url],
                        env={"OPENAI_API_KEY": KEY}).start()
        yield {**procs, "router": router, "model": model_dir.name}
    finally:
        if router is not None:
            router.kill()
        c.close()
        print(c.logs(), "\n==== router ====\n", router.tail() if router else "")


def test_greedy_texts_through_the_router_equal_colocated_and_d_pulls(
        rig: dict[str, Any]) -> None:
    """Completions and chat, streamed and whole: the router's answer equals a colocated
    engine's given the ``min_tokens: 1`` the router adds for P (P then cannot sample EOS
    first; without it a colocated engine may), and each one's KV was pulled by D."""
    p, d, router, model = rig["p"], rig["d"], rig["router"], rig["model"]
    before = {k: metrics(rig[k].url) for k in ("p", "d")}
    n = 0
    for prompt in PROMPTS:
        for kind in ("completion", "chat"):
            for stream in (False, True):
                kw: dict[str, Any] = {"model": model, "max_tokens": 12, "temperature": 0}
                if kind == "chat":
                    kw["messages"] = [{"role": "user", "content": prompt}]
                else:
                    kw["prompt"] = prompt
                want = ask(client(rig["colo"].url), kind, stream,
                           {**kw, "extra_body": {"min_tokens": 1}})
                got = ask(client(router.url), kind, stream, kw)
                assert got == want, (prompt, kind, stream)
                n += 1
    pools_free(d, prefill=(p,))
    after = {k: metrics(rig[k].url) for k in ("p", "d")}

    def delta(k: str, name: str) -> float:
        return metric(after[k], name) - metric(before[k], name)

    # Every request's KV came from P: pulled, or (the same prompt again) found in D's
    # prefix cache; none fell back to recompute.
    assert delta("d", "kvrelay_kv_transfers_total") >= len(PROMPTS) * 2
    assert delta("d", "kvrelay_kv_load_fallbacks_total") == 0
    assert delta("p", "kvrelay_leases_created_total") == n
    assert delta("p", 'kvrelay_leases_released_total{reason="done"}') == n
    assert delta("d", 'vllm:request_success_total{finished_reason="length"}') + delta(
        "d", 'vllm:request_success_total{finished_reason="stop"}') == n
    # The router's own fields (no_stop_trim, return_hidden_states, ...) are ignored with
    # one warning per field name, not one per request.
    for proc in (p, d):
        warned = [line for line in proc.tail(10**6).splitlines() if "not known here" in line]
        names = [n for line in warned for n in line.split("[", 1)[1].split("]")[0].split(", ")]
        assert warned and len(names) == len(set(names)), warned


def test_a_client_that_leaves_mid_stream_frees_d_at_once(rig: dict[str, Any]) -> None:
    """The router closes its stream from D when its client leaves: D aborts the request
    (its blocks free at once, not after max_tokens); P's lease ended when D pulled."""
    p, d, router, model = rig["p"], rig["d"], rig["router"], rig["model"]
    aborted = metric(metrics(d.url), 'kvrelay_requests_finished_total{reason="abort"}')
    body = {"model": model, "prompt": "hold on", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data:"))
    assert poll(lambda: metric(metrics(d.url), 'kvrelay_requests_finished_total'
                               '{reason="abort"}') == aborted + 1, 10), d.tail()
    pools_free(d, prefill=(p,), timeout=5)


def test_the_api_key_reaches_the_engines_through_the_router(rig: dict[str, Any]) -> None:
    """The engines' --api-key is met by the router's OPENAI_API_KEY. The router does not
    check its clients' keys (recorded, a router choice: it sends its own key in place of
    the client's), so a client with a wrong key is answered; straight to an engine, the
    same key gets a 401."""
    router, model, d = rig["router"], rig["model"], rig["d"]
    for key in (KEY, "wrong"):
        r = client(router.url, key).completions.create(model=model, prompt="hi", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens == 3
    direct = httpx.post(d.url + "/v1/completions", timeout=30,
                        json={"model": model, "prompt": "hi", "max_tokens": 3},
                        headers={"Authorization": "Bearer wrong"})
    assert direct.status_code == 401, direct.text
    pools_free(d, prefill=(rig["p"],))


def test_llm_d_sidecar_nixlv2_request_shape(rig: dict[str, Any]) -> None:
    """llm-d's decode sidecar in ``nixlv2`` mode: P gets the request with
    ``do_remote_decode`` and ``max_tokens: 1`` (not streamed), D the client's request with
    P's ``kv_transfer_params`` verbatim. Completions and chat, whole and streamed on D."""
    p, d, model = rig["p"], rig["d"], rig["model"]
    auth = {"Authorization": f"Bearer {KEY}"}
    fallbacks = metric(metrics(d.url), "kvrelay_kv_load_fallbacks_total")
    done = metric(metrics(p.url), 'kvrelay_leases_released_total{reason="done"}')
    for path, body in (
        ("/v1/completions", {"model": model, "prompt": PROMPTS[1], "max_tokens": 10,
                             "temperature": 0}),
        ("/v1/chat/completions", {"model": model, "max_tokens": 10, "temperature": 0,
                                  "messages": [{"role": "user", "content": PROMPTS[0]}]}),
    ):
        want = httpx.post(rig["colo"].url + path, json={**body, "min_tokens": 1},
                          headers=auth, timeout=30).json()["choices"][0]
        for stream in (False, True):
            first = httpx.post(p.url + path, headers=auth, timeout=30, json={
                **body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
                    "do_remote_decode": True, "do_remote_prefill": False,
                    "remote_engine_id": None, "remote_block_ids": None,
                    "remote_host": None, "remote_port": None}})
            assert first.status_code == 200, first.text
            params = first.json()["kv_transfer_params"]
            second = {**body, "stream": stream, "kv_transfer_params": params}
            if not stream:
                got = httpx.post(d.url + path, json=second, headers=auth,
                                 timeout=30).json()["choices"][0]
                text = got["text"] if "text" in got else got["message"]["content"]
            else:
                text = ""
                with httpx.stream("POST", d.url + path, json=second, headers=auth,
                                  timeout=30) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            for ch in httpx.Response(200, content=line[6:]).json()["choices"]:
                                text += ch.get("text") or ch.get("delta", {}).get("content") or ""
            assert text == (want["text"] if "text" in want else want["message"]["content"])
    pools_free(d, prefill=(p,))
    assert metric(metrics(d.url), "kvrelay_kv_load_fallbacks_total") == fallbacks
    assert metric(metrics(p.url), 'kvrelay_leases_released_total{reason="done"}') == done + 4
    pools_free(d, prefill=(p,))


def test_drain_leaves_the_rotation_and_a_dead_d_lets_the_lease_expire(
        model_dir: Path, tmp_path: Path) -> None:
    """Two decode engines behind the router (health checked every second, no retries).
    One drains (SIGTERM while a long request holds it): its /health says 503, the router
    marks it unhealthy, and every request after goes to the other one; it exits 0. Then
    the other is killed: the router answers the client with an error (recorded: 500, no
    retry on another engine, there is none) and P, whose lease nobody will pull, frees
    it when the lease times out (2 s)."""
    c = Cluster(model_dir, tmp_path)
    router = None
    try:
        p = c.prefill()
        d1, d2 = c.decode("decode-1", "tcp"), c.decode("decode-2", "tcp")
        for e in (p, d1, d2):
            e.wait_healthy()
        router = Router(tmp_path / "router.log", [p.url], [d1.url, d2.url], (
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--disable-retries")).start()
        model = model_dir.name
        hold = threading.Thread(target=lambda: httpx.post(
            d2.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "hold", "max_tokens": 400, "ignore_eos": True}))
        hold.start()
        assert poll(lambda: metric(metrics(d2.url), "kvrelay_requests_running") == 1, 30)
        d2.signal(signal.SIGTERM)
        assert poll(lambda: not router.healthy(d2.url), 30), router.tail()
        served = metric(metrics(d1.url), "kvrelay_requests_finished_total")
        for i in range(8):
            r = client(router.url, "none").completions.create(
                model=model, prompt=f"request {i}", max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens == 3
        assert metric(metrics(d1.url), "kvrelay_requests_finished_total") == served + 8
        hold.join(120)
        assert d2.proc is not None and d2.proc.wait(60) == 0
        # D killed: P's lease has nobody to pull it.
        expired = metric(metrics(p.url), 'kvrelay_leases_released_total{reason="expired"}')
        d1.kill()
        answer = httpx.post(router.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "nobody decodes this", "max_tokens": 3})
        assert answer.status_code >= 500, answer.text  # the router's answer, recorded
        assert poll(lambda: metric(metrics(p.url), 'kvrelay_leases_released_total'
                                   '{reason="expired"}') == expired + 1, 10), p.tail()
        pools_free(p, prefill=(p,))
    finally:
        if router is not None:
            router.kill()
        c.close()
        print(c.logs(), "\n==== router ====\n", router.tail() if router else "")


def test_a_client_that_leaves_during_the_prefill_leaves_no_lease(tmp_path: Path) -> None:
    """The client goes while P still computes its prompt (a model slow enough to catch it
    there, chunks of 16 tokens): the router drops its request to P, P aborts it before
    any lease is made, and nothing is held. (Between P's answer and the router's request
    to D there is no such cover: a lease made then waits for --lease-timeout.)"""
    model = write_fat_model(tmp_path / "fat")
    c = Cluster(model, tmp_path)
    router = None
    try:
        p, d = c.prefill("prefill", "--max-num-batched-tokens", "16"), c.decode("decode", "tcp")
        for e in (p, d):
            e.wait_healthy()
        router = Router(tmp_path / "router.log", [p.url], [d.url]).start()
        body = json.dumps({"model": model.name, "max_tokens": 5,
                           "prompt": " ".join(f"w{i}" for i in range(100))}).encode()
        s = socket.create_connection(("127.0.0.1", router.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert poll(lambda: metric(metrics(p.url), "kvrelay_requests_running") == 1, 30)
        s.close()
        assert poll(lambda: metric(metrics(p.url), 'kvrelay_requests_finished_total'
                                   '{reason="abort"}') == 1, 30), p.tail()
        m = metrics(p.url)
        assert metric(m, "kvrelay_leases_created_total") == 0, m
        pools_free(p, d, prefill=(p,))
    finally:
        if router is not None:
            router.kill()
        c.close()
        print(c.logs(), "\n==== router ====\n", router.tail() if router else "")
