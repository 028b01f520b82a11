"""A decode engine's queue of pulled requests is bounded: one more gets a 429.

Real processes: P (lease timeout 60 s), D started with ``--max-num-seqs 1
--max-queued-kv-requests 1`` and ``KVRELAY_FAULT_TRANSFER_DELAY_S`` (every pull waits
before it writes, so a pulled request holds D's one slot for a while), and the proxy.
With one pulled request loading and one queued, the next gets HTTP 429 with
``Retry-After`` and an OpenAI error body at once, instead of waiting without end; its
lease is untouched (the same params pull fine later). Through the proxy the 429 reaches
the client with its ``Retry-After`` and the proxy gives the lease back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Proc, metrics, poll, pools_free, sample

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PULL_DELAY_S = 6.0
LEASE = ("--lease-timeout", "60")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    # The delay acts on D's pulls only (P and the proxy never pull).
    c = Cluster(model, tmp_path_factory.mktemp("kv-queue-bound-logs"),
                extra_env={"KVRELAY_FAULT_TRANSFER_DELAY_S": str(PULL_DELAY_S)})
    try:
        p = c.prefill("prefill", *LEASE)
        d = c.decode("decode", "shm", "--max-num-seqs", "1", "--max-queued-kv-requests", "1",
                     *LEASE)
        for x in (p, d):
            x.wait_healthy()
        proxy = c.proxy([p], [d]).wait_healthy()
        yield {"p": p, "d": d, "proxy": proxy, "model": model.name}
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def body(model: str, prompt: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True}


def lease(p: Proc, b: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(p.url + "/v1/completions", timeout=60,
                   json={**b, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return dict(r.json()["kv_transfer_params"], first_token_sent=True)


def decode(d: Proc, b: dict[str, Any], params: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + "/v1/completions", timeout=120,
                      json={**b, "kv_transfer_params": params})


def fill(c: dict[str, Any]) -> tuple[list[threading.Thread], list[httpx.Response]]:
    """One pulled request loading on D (its slot) and one queued behind it."""
    p, d, model = c["p"], c["d"], c["model"]
    answers: list[httpx.Response] = []
    threads = []
    for i in range(2):
        b = body(model, f"fill {i} {threading.get_ident()}")
        params = lease(p, b)
        t = threading.Thread(target=lambda b=b, params=params: answers.append(
            decode(d, b, params)), daemon=True)
        t.start()
        threads.append(t)

    def full() -> bool:
        m = metrics(d.url)
        return sample(m, "kvrelay_kv_loads") == 2 and sample(m, "kvrelay_requests_waiting") == 1

    assert poll(full, 30), "D never had one pull loading and one queued"
    return threads, answers


def held(p: Proc) -> float:
    m = metrics(p.url)
    return sample(m, "kvrelay_leases", state="held") + sample(m, "kvrelay_leases",
                                                              state="pulling")


def test_a_pulled_request_beyond_the_queue_bound_gets_a_429_and_its_lease_stays(
    cluster: dict[str, Any],
) -> None:
    p, d, model = cluster["p"], cluster["d"], cluster["model"]
    b = body(model, "one too many")
    params = lease(p, b)
    threads, answers = fill(cluster)
    r = decode(d, b, params)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "kv_queue_full" and "max_queued_kv_requests 1" in err["message"]
    assert held(p) >= 1, "the refused request's lease was given up"
    for t in threads:
        t.join(120)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    r = decode(d, b, params)  # the same params, later: the lease was left for this
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    pools_free(d, prefill=(p,), timeout=20)


def test_the_proxy_passes_the_429_with_retry_after_and_gives_the_lease_back(
    cluster: dict[str, Any],
) -> None:
    p, d, proxy, model = cluster["p"], cluster["d"], cluster["proxy"], cluster["model"]
    aborted = sample(metrics(p.url), "kvrelay_leases_released_total", reason="aborted")
    threads, answers = fill(cluster)
    r = httpx.post(proxy.url + "/v1/completions", json=body(model, "through the proxy"),
                   timeout=60)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "kv_queue_full"
    assert poll(lambda: sample(metrics(p.url), "kvrelay_leases_released_total",
                                   reason="aborted") == aborted + 1, 10), "lease not released"
    for t in threads:
        t.join(120)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    # A busy decode engine is not an unhealthy one: the proxy serves through it at once.
    r = httpx.post(proxy.url + "/v1/completions", json=body(model, "after the 429"),
                   timeout=60)
    assert r.status_code == 200, r.text
    pools_free(d, prefill=(p,), timeout=20)
