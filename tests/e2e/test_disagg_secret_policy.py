"""--relay-secret and --kv-load-failure-policy with real processes.

A prefill engine with a relay secret serves decode engines that know it; one that
does not is refused at HELLO and never reads: with the recompute policy it prefills
locally and answers as a colocated engine would, with the fail policy the request
fails with an error naming the prefill engine. Pools end entirely free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Proc, metric, metrics, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SECRET = ("--relay-secret", "s3cret")
WRONG = ("--relay-secret", "not-the-secret")


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("secret-logs"))
    try:
        out = {
            "colo": c.colocated(),
            "p": c.prefill("prefill", *SECRET),
            "d_ok": c.decode("decode-ok", "tcp", *SECRET),
            "d_recompute": c.decode("decode-wrong-recompute", "tcp", *WRONG),
            "d_fail": c.decode("decode-wrong-fail", "shm", *WRONG,
                               "--kv-load-failure-policy", "fail"),
        }
        for p in out.values():
            p.wait_healthy()
        MODEL["name"] = httpx.get(out["colo"].url + "/v1/models").json()["data"][0]["id"]
        yield out
    finally:
        c.close()
        print(c.logs())


MODEL = {"name": ""}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL["name"], "prompt": "The quick brown fox jumps over", "max_tokens": 6,
            "temperature": 0, **extra}


def post(proc: Proc, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(proc.url + "/v1/completions", json=payload, timeout=30)


def lease(p: Proc) -> tuple[str, dict[str, Any]]:
    r = post(p, body(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert r.status_code == 200, r.text
    # Marked as kvrelay's proxy does: the first token's text is the caller's to send.
    return r.json()["choices"][0]["text"], {**r.json()["kv_transfer_params"],
                                            "first_token_sent": True}


def test_the_right_secret_pulls(procs: dict[str, Proc]) -> None:
    want = post(procs["colo"], body()).json()["choices"][0]["text"]
    first, params = lease(procs["p"])
    before = metric(metrics(procs["d_ok"].url), "kvrelay_kv_transfer_bytes_total")
    r = post(procs["d_ok"], body(kv_transfer_params=params))
    assert r.status_code == 200, r.text
    assert first + r.json()["choices"][0]["text"] == want
    assert metric(metrics(procs["d_ok"].url), "kvrelay_kv_transfer_bytes_total") > before
    pools_free(procs["d_ok"], prefill=(procs["p"],))


def test_a_wrong_secret_never_reads_and_recomputes(procs: dict[str, Proc]) -> None:
    d = procs["d_recompute"]
    want = post(procs["colo"], body()).json()["choices"][0]["text"]
    first, params = lease(procs["p"])
    r = post(d, body(kv_transfer_params=params))
    assert r.status_code == 200, r.text
    assert first + r.json()["choices"][0]["text"] == want
    m = metrics(d.url)
    assert metric(m, "kvrelay_kv_transfer_bytes_total") == 0
    assert metric(m, "kvrelay_kv_load_fallbacks_total") >= 1
    # Nobody acquired the lease: P frees it at its (2 s) deadline, as expired.
    pools_free(d, prefill=(procs["p"],), timeout=10)
    assert metric(metrics(procs["p"].url),
                  'kvrelay_leases_released_total{reason="expired"}') >= 1


def test_a_wrong_secret_with_policy_fail_fails_clearly(procs: dict[str, Proc]) -> None:
    d = procs["d_fail"]
    _, params = lease(procs["p"])
    r = post(d, body(kv_transfer_params=params))
    assert r.status_code >= 500, r.text
    message = r.json()["error"]["message"]
    assert "prefill relay at" in message and "relay secret" in message, r.text
    pools_free(d, prefill=(procs["p"],), timeout=10)
    # The engine still serves requests of its own.
    assert post(d, body()).status_code == 200


def test_a_wrong_secret_is_reported_at_once_as_auth_failed(procs: dict[str, Proc]) -> None:
    """Bug: a D with the wrong secret waited the full timeout, reported `unreachable`,
    and neither side logged anything. Now P refuses HELLO with code auth_failed (and
    logs it with the peer's address); D's client answers the undelivered ACQUIRE at
    once with that code, so the fallback is counted as auth_failed, not a timeout."""
    d = procs["d_recompute"]
    _, params = lease(procs["p"])
    assert post(d, body(kv_transfer_params=params)).status_code == 200
    m = metrics(d.url)
    assert metric(m, 'kvrelay_kv_load_fallbacks_total{reason="auth_failed"}') >= 1
    assert metric(m, 'kvrelay_kv_load_fallbacks_total{reason="unreachable"}') == 0
    assert "failed authentication" in procs["p"].tail(20000)
    assert "auth_failed" in d.tail(20000)
