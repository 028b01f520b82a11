"""Disaggregated serving gives the same tokens as a colocated engine.

One module-scoped cluster of real processes: a colocated ``kvrelay serve``, one
prefill engine, one decode engine per transport (shm, tcp) and one proxy per
decode engine. 30 requests per transport through the proxy with the openai client
(greedy and seeded sampling, streamed and not, completions and chat) must equal the
colocated answers (text, completion_tokens, finish_reason). Afterwards both pools
are entirely free, no lease is held and D moved bytes over its transport.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, ask, metric, metrics, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPTS = (
    "The quick brown fox",
    "Once upon a time in a land far away there lived",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "hello",
    "A much longer prompt that spans several KV blocks of four tokens each, so that the "
    "transfer moves more than one block and the last block is partial.",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    c = Cluster(model_dir, tmp_path_factory.mktemp("disagg-eq-logs"))
    try:
        procs = {"colo": c.colocated(), "p": c.prefill(),
                 "d_shm": c.decode("decode-shm", "shm"), "d_tcp": c.decode("decode-tcp", "tcp")}
        for p in procs.values():
            p.wait_healthy()
        procs["proxy_shm"] = c.proxy([procs["p"]], [procs["d_shm"]], "proxy-shm")
        procs["proxy_tcp"] = c.proxy([procs["p"]], [procs["d_tcp"]], "proxy-tcp")
        procs["proxy_shm"].wait_healthy()
        procs["proxy_tcp"].wait_healthy()
        yield procs
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=30)


def cases(model: str) -> list[tuple[str, bool, dict[str, Any]]]:
    """30 requests: (kind, stream, kwargs)."""
    out = []
    for i in range(30):
        prompt = PROMPTS[i % len(PROMPTS)]
        sampling: dict[str, Any] = (
            {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i})
        kw: dict[str, Any] = {"model": model, "max_tokens": 4 + (i % 7) * 2, **sampling}
        if i % 3 == 0:
            kw["extra_body"] = {"ignore_eos": True}
        kind = "chat" if i % 4 in (1, 2) else "completion"
        if kind == "chat":
            kw["messages"] = [{"role": "user", "content": prompt}]
        else:
            kw["prompt"] = prompt
        out.append((kind, i % 5 in (0, 2, 3), kw))
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_disagg_equals_colocated(cluster: dict[str, Proc], model_dir: Path,
                                 transport: str) -> None:
    colo, proxy = client(cluster["colo"]), client(cluster[f"proxy_{transport}"])
    p, d = cluster["p"], cluster[f"d_{transport}"]
    bytes_before = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total")
    mismatches = []
    for i, (kind, stream, kw) in enumerate(cases(model_dir.name)):
        want = ask(colo, kind, stream, kw)
        got = ask(proxy, kind, stream, kw)
        if got != want:
            mismatches.append((i, kind, stream, kw.get("temperature"), want, got))
    assert not mismatches, "\n".join(map(repr, mismatches))
    pools_free(d, prefill=(p,), timeout=10)
    assert metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > bytes_before


def test_one_token_answers_equal_colocated(cluster: dict[str, Proc], model_dir: Path) -> None:
    """Bug (found by ``kvrelay bench soak``): with max_tokens 1 the proxy took P's
    handed-off answer as the whole choice, but a handed-off answer holds back a partial
    character (or a possible stop string) for D, which never came: the text was '' where
    a colocated engine's ends with what it held. The proxy now asks P for such a leg as
    plain work (no lease)."""
    colo, proxy = client(cluster["colo"]), client(cluster["proxy_shm"])
    mismatches = []
    for prompt in PROMPTS:
        for kind in ("completion", "chat"):
            kw: dict[str, Any] = {"model": model_dir.name, "max_tokens": 1,
                                  "temperature": 0.0}
            kw["messages" if kind == "chat" else "prompt"] = (
                [{"role": "user", "content": prompt}] if kind == "chat" else prompt)
            for stream in (False, True):
                want, got = ask(colo, kind, stream, kw), ask(proxy, kind, stream, kw)
                if got != want:
                    mismatches.append((kind, stream, prompt[:20], want, got))
    assert not mismatches, "\n".join(map(repr, mismatches))
    pools_free(cluster["d_shm"], prefill=(cluster["p"],), timeout=10)
