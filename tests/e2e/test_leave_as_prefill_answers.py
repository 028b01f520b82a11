"""A client that leaves while P writes its answer: the lease is released at once.

Bug (issue 21, ``kvrelay bench chaos --leave wait_p``: 32 of 214 leases expired): the
proxy cancels its prefill call when its client leaves; if P had already made the lease
and was writing its answer, the proxy never read the lease id, so it sent no release and
the lease was held until it expired. The proxy now names each prefill call with a
``release_key`` and releases by it whenever a call ends without an answer it read.

Real processes: P (with ``KVRELAY_FAULT_ANSWER_DELAY_S``, a window between making the
lease and writing the answer, and a lease timeout far beyond the test so expiry cannot
pass for a release), D and the proxy. Without the fix the first test times out with the
lease still held.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.e2e.cluster import Cluster, Proc, held_leases, metrics, poll, pools_free, sample

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ANSWER_DELAY_S = 6.0  # P waits this long after making the lease before it answers
LEASE_TIMEOUT = ("--lease-timeout", "60")  # expiry can never stand in for a release


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("leave-as-p-answers-logs"),
                extra_env={"KVRELAY_FAULT_ANSWER_DELAY_S": str(ANSWER_DELAY_S)})
    try:
        yield c.pd(LEASE_TIMEOUT, LEASE_TIMEOUT)
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def released(p: Proc) -> dict[str, float]:
    m = metrics(p.url)
    return {r: sample(m, "kvrelay_leases_released_total", reason=r)
            for r in ("done", "failed", "aborted", "expired")}


def model_name(p: Proc) -> str:
    return str(httpx.get(p.url + "/v1/models", timeout=10).json()["data"][0]["id"])


def test_a_client_that_leaves_as_p_writes_its_answer_has_its_lease_released_at_once(
    cluster: dict[str, Proc],
) -> None:
    p, d, proxy = cluster["p"], cluster["d"], cluster["proxy"]
    before = released(p)
    body = json.dumps({"model": model_name(p), "prompt": "leave as P answers",
                       "max_tokens": 8, "stream": True}).encode()
    where = urlsplit(proxy.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
                  b"Content-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # P has made the lease and now waits before it writes its answer: leave.
        assert poll(lambda: held_leases(metrics(p.url)) == 1, 60), "no lease made"
    t_left = time.monotonic()
    # The proxy cancelled its call to P without reading the answer: only the
    # release_key can give the lease back, and it must do so long before P answers
    # (let alone before the lease's 60 s deadline).
    assert poll(lambda: held_leases(metrics(p.url)) == 0, ANSWER_DELAY_S - 1), \
        "the lease of a client that left is still held: it would expire"
    took = time.monotonic() - t_left
    after = released(p)
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"done": 0, "failed": 0, "aborted": 1, "expired": 0}, delta
    print(f"released {took:.2f} s after the client left")
    pools_free(d, prefill=(p,), timeout=ANSWER_DELAY_S + 5)


def test_a_release_key_sent_before_the_lease_is_made_releases_it_when_made(
    cluster: dict[str, Proc],
) -> None:
    """The other order: the proxy's release by key reaches P before P has made the
    lease (P still prefilling). P remembers the key and releases the lease at once."""
    p = cluster["p"]
    before = released(p)
    key = secrets.token_urlsafe(16)
    r = httpx.post(p.url + "/v1/kv/release", json={"kv_transfer_params": {"release_key": key}},
                   timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "pending", r.text
    r = httpx.post(p.url + "/v1/completions", timeout=60, json={
        "model": model_name(p), "prompt": "released before it was made", "max_tokens": 4,
        "kv_transfer_params": {"do_remote_decode": True, "release_key": key}})
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"]["lease_id"]
    assert poll(lambda: held_leases(metrics(p.url)) == 0, 10), "the lease is held"
    after = released(p)
    assert after["aborted"] - before["aborted"] == 1 and after["expired"] == before["expired"]


@pytest.mark.parametrize("key", ["short", "x" * 65, 12345, "has space in it!!!!"])
def test_a_bad_release_key_is_a_400_naming_kv_transfer_params(
    cluster: dict[str, Proc], key: Any,
) -> None:
    p = cluster["p"]
    r = httpx.post(p.url + "/v1/kv/release", json={"kv_transfer_params": {"release_key": key}},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    r = httpx.post(p.url + "/v1/completions", timeout=30, json={
        "model": model_name(p), "prompt": "x", "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True, "release_key": key}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
