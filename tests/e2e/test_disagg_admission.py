"""A decode engine admits pulled requests within ``--max-num-seqs``.

Real processes: one prefill engine, one decode engine started with ``--max-num-seqs 2``
and the proxy. Six concurrent streamed completions go through the proxy; while they run,
D's ``kvrelay_requests_running`` is read over and over. Before the fix, requests whose KV
was pulled were admitted outside the limit (6 admitted, the next batch ran 6).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, ask, metric, metrics, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MAX_TOKENS = 120  # long enough that six decodes would overlap on D without the limit
# Requests queued on D behind the limit wait before they acquire their lease: P's
# acquire deadline must outlast the queue on a busy machine (the cluster's is 2 s).
LONG_LEASE = ("--lease-timeout", "30")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("disagg-admission-logs"))
    try:
        yield c.pd(LONG_LEASE, ("--max-num-seqs", "2", *LONG_LEASE))
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def test_six_concurrent_pulled_requests_under_max_num_seqs_2_never_run_more_than_2(
    cluster: dict[str, Proc],
) -> None:
    d, proxy = cluster["d"], cluster["proxy"]
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    model = client.models.list().data[0].id
    seen: list[float] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=5) as http:
            while not done.is_set():
                text = http.get(d.url + "/metrics").text
                for line in text.splitlines():
                    if line.startswith("kvrelay_requests_running"):
                        seen.append(float(line.rpartition(" ")[2]))

    def one(i: int) -> tuple[str, int, str]:
        kw = {"model": model, "prompt": f"request {i}: the quick brown fox", "max_tokens":
              MAX_TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
        return ask(client, "completion", True, kw)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(one, range(6)))
    finally:
        done.set()
        watcher.join(10)
    assert [(n, finish) for _, n, finish in answers] == [(MAX_TOKENS, "length")] * 6
    assert seen and max(seen) <= 2, f"D ran {max(seen)} requests at once"
    m = metrics(d.url)
    # Every one of them was pulled: none fell back to a local prefill on D.
    assert metric(m, "kvrelay_kv_transfer_seconds_count") == 6, m
    assert metric(m, "kvrelay_kv_load_fallbacks_total") == 0, m
    pools_free(d, prefill=(cluster["p"],))
