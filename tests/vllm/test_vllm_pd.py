"""vLLM prefill and decode engines with KvRelayConnector over tcp, behind `kvrelay proxy`,
driven by the official openai client (docs/vllm.md). One module-scoped pair:

- P: kv_producer, lease_timeout 8 s; D: kv_consumer with every pull held back 1 s
  (KVRELAY_FAULT_TRANSFER_DELAY_S, inside the connector), so a test can act while a
  lease is PULLING. Both: fp32, ~25 KV blocks of 128 tokens (reuse comes quickly),
  kv_load_failure_policy recompute.
- The reference is colocated vLLM: P itself, asked without kv_transfer_params.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.server.demo import free_port
from tests.vllm.pair import REPO, VllmEngine, missing

# `make test` sets KVRELAY_REQUIRE_VLLM=1 after making the venv: there a missing venv is a
# failure, not a skip, so CI cannot pass without having run vLLM.
if missing() and os.environ.get("KVRELAY_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"KVRELAY_REQUIRE_VLLM=1 but {missing()}")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")]

LEASE_TIMEOUT = 8.0
PROMPT = "Write one sentence about the sea:"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PULLING = r"kvrelay: pulling the KV of request"
FELL_BACK = r"kvrelay: KV load of \S+ failed"


class Pair:
    def __init__(self, tmp: Path) -> None:
        extra = {"lease_timeout": LEASE_TIMEOUT, "lease_max": 60}
        # vLLM binds each engine's worker to the cores it picks, both to core 0 here
        # unless told: one core each, as two engines on one host should be.
        self.p = VllmEngine("prefill", "kv_producer", tmp / "p.log", extra,
                            env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
        self.d = VllmEngine("decode", "kv_consumer", tmp / "d.log", extra,
                            env={"KVRELAY_FAULT_TRANSFER_DELAY_S": "1.0",
                                 "VLLM_CPU_OMP_THREADS_BIND": str(1 % (os.cpu_count() or 1))})
        self.proxy_port = free_port()
        self.proxy: subprocess.Popen[bytes] | None = None
        self.proxy_log = tmp / "proxy.log"

    def start(self) -> float:
        t0 = time.monotonic()
        self.p.start()
        self.d.start()
        self.p.wait_healthy()
        self.d.wait_healthy()
        started = time.monotonic() - t0
        for engine in (self.p, self.d):  # a cold engine's first request takes seconds
            httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
                "model": "smol", "prompt": "warm up", "max_tokens": 2}).raise_for_status()
        with open(self.proxy_log, "ab") as out:
            self.proxy = subprocess.Popen(
                [sys.executable, "-m", "kvrelay", "proxy", "--prefill", self.p.url,
                 "--decode", self.d.url, "--host", "127.0.0.1", "--port",
                 str(self.proxy_port)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.proxy_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proxy.poll() is not None:
                raise RuntimeError("the proxy did not start:\n" + self.proxy_log.read_text())
            time.sleep(0.1)
        return started

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def close(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(10)
        self.p.kill()
        self.d.kill()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pr = Pair(tmp_path_factory.mktemp("vllm"))
    try:
        started = pr.start()
        print(f"\nvLLM P and D healthy after {started:.0f} s (started side by side)")
        yield pr
    finally:
        pr.close()


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def completion(url: str, stream: bool) -> str:
    c = openai_client(url)
    kw: dict[str, Any] = dict(model="smol", prompt=PROMPT, max_tokens=24, temperature=0)
    if stream:
        return "".join(ch.choices[0].text for ch in
                       c.completions.create(stream=True, **kw) if ch.choices)
    return str(c.completions.create(**kw).choices[0].text)


def chat(url: str, stream: bool) -> str:
    c = openai_client(url)
    kw: dict[str, Any] = dict(model="smol", messages=MESSAGES, max_tokens=24, temperature=0)
    if stream:
        return "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(stream=True, **kw) if ch.choices)
    return str(c.chat.completions.create(**kw).choices[0].message.content)


def lease_from_p(pr: Pair, prompt: str = PROMPT) -> dict[str, Any]:
    r = httpx.post(f"{pr.p.url}/v1/completions", timeout=120, json={
        "model": "smol", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    r.raise_for_status()
    params = r.json()["kv_transfer_params"]
    assert params["lease_id"] and params["resends_first_token"] is True
    return dict(params)


def decode_on_d(pr: Pair, params: dict[str, Any], prompt: str = PROMPT,
                timeout: float = 120) -> str:
    r = httpx.post(f"{pr.d.url}/v1/completions", timeout=timeout, json={
        "model": "smol", "prompt": prompt, "max_tokens": 24, "temperature": 0,
        "kv_transfer_params": params})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def colocated(pr: Pair, prompt: str = PROMPT) -> str:
    return completion(pr.p.url, False) if prompt == PROMPT else str(httpx.post(
        f"{pr.p.url}/v1/completions", timeout=120, json={
            "model": "smol", "prompt": prompt, "max_tokens": 24, "temperature": 0,
        }).json()["choices"][0]["text"])


def failing(out: dict[str, Exception], pair: Pair, params: dict[str, Any],
            timeout: float) -> None:
    try:
        decode_on_d(pair, params, timeout=timeout)
    except Exception as e:  # what the test expects, recorded for it
        out["error"] = e


def fill_p(pr: Pair, n: int = 5) -> None:
    """Colocated requests on P long enough to pass every block of its small cache
    through other requests (vLLM's free queue hands the oldest free block out first)."""
    for i in range(n):
        prompt = f"{i} " + "the tide rolls in and out again " * 120
        httpx.post(f"{pr.p.url}/v1/completions", timeout=120, json={
            "model": "smol", "prompt": prompt, "max_tokens": 1}).raise_for_status()


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_texts_equal_colocated_vllm(pair: Pair, kind: str, stream: bool) -> None:
    ask = completion if kind == "completion" else chat
    want = ask(pair.p.url, False)
    pulls, fallbacks = pair.d.count(PULLING), pair.d.count(FELL_BACK)
    assert ask(pair.proxy_url, stream) == want
    assert pair.d.count(PULLING) == pulls + 1  # the KV came over the relay
    assert pair.d.count(FELL_BACK) == fallbacks  # and was not recomputed


def test_replayed_params_never_commit(pair: Pair) -> None:
    want = colocated(pair)
    params = lease_from_p(pair)
    assert decode_on_d(pair, params) == want
    consumed = pair.d.count(r"lease already consumed")
    assert decode_on_d(pair, params) == want  # recomputed on D
    pair.d.wait_log(r"lease already consumed", consumed + 1)


def test_blocks_reused_under_a_delayed_pull_are_fenced(pair: Pair) -> None:
    """D acquires, then stalls (SIGSTOP) before its copy; P's lease expires without
    heartbeats, its blocks go to other requests; D resumes and never decodes on them:
    whichever comes first (its heartbeat timer giving up on P, the READ refused, the
    commit refused) ends the copy without a done verdict, and D recomputes the text."""
    want = colocated(pair)
    params = lease_from_p(pair)
    pulls, fallbacks = pair.d.count(PULLING), pair.d.count(FELL_BACK)
    expired = pair.p.count(r"ended \(expired\)")
    out: dict[str, str] = {}
    t = threading.Thread(target=lambda: out.update(text=decode_on_d(pair, params)))
    t.start()
    pair.d.wait_log(PULLING, pulls + 1)
    pair.d.signal_all(signal.SIGSTOP)
    try:
        pair.p.wait_log(r"ended \(expired\)", expired + 1, timeout=4 * LEASE_TIMEOUT)
        fill_p(pair)
    finally:
        pair.d.signal_all(signal.SIGCONT)
    t.join(120)
    assert out.get("text") == want
    assert pair.d.count(FELL_BACK) == fallbacks + 1


def test_lease_expired_before_acquire_recomputes(pair: Pair) -> None:
    want = colocated(pair)
    params = lease_from_p(pair)
    expired = pair.p.count(r"ended \(expired\)")
    pair.p.wait_log(r"ended \(expired\)", expired + 1, timeout=4 * LEASE_TIMEOUT)
    fill_p(pair)
    fallbacks = pair.d.count(FELL_BACK)
    assert decode_on_d(pair, params) == want
    assert pair.d.count(FELL_BACK) == fallbacks + 1


def test_abort_while_d_waits_for_kv(pair: Pair) -> None:
    params = lease_from_p(pair)
    pulls, aborted = pair.d.count(PULLING), pair.p.count(r"ended \(aborted\)")

    out: dict[str, Exception] = {}
    t = threading.Thread(target=failing, args=(out, pair, params, 0.5))  # leaves early
    t.start()
    pair.d.wait_log(PULLING, pulls + 1)
    t.join(30)
    assert isinstance(out.get("error"), httpx.TimeoutException)
    # D told P (ABORT) when the aborted pull stopped: P frees at once, not at expiry.
    pair.p.wait_log(r"ended \(aborted\)", aborted + 1, timeout=LEASE_TIMEOUT)
    pair.d.wait_kv_free(timeout=30)
    pair.p.wait_kv_free(timeout=30)
    assert completion(pair.proxy_url, False) == colocated(pair)  # both still serve


def test_decode_killed_mid_pull_p_frees_at_lease_timeout(pair: Pair) -> None:
    """Last: it kills D."""
    params = lease_from_p(pair)
    pulls, expired = pair.d.count(PULLING), pair.p.count(r"ended \(expired\)")
    out: dict[str, Exception] = {}
    t = threading.Thread(target=failing, args=(out, pair, params, 120))
    t.start()
    pair.d.wait_log(PULLING, pulls + 1)
    pair.d.kill()
    t.join(30)
    assert isinstance(out.get("error"), httpx.HTTPError)
    pair.p.wait_log(r"ended \(expired\)", expired + 1, timeout=4 * LEASE_TIMEOUT)
    pair.p.wait_kv_free(timeout=30)
    assert completion(pair.p.url, False)  # P keeps serving
