"""A real decode engine against params a hostile client writes (issue 21).

One prefill engine and one decode engine (tcp) as real processes on localhost, the
tiny model. Clients POST kv_transfer_params straight to D, as a client that bypasses
the proxy may. Each test ends with a genuine pull from the same P that loads its KV:
no request, however forged, may cut D off from P or leak a resource.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Proc, metric, metrics, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


class Pair:
    def __init__(self, c: Cluster, model: str) -> None:
        self.model = model
        self.p = c.prefill()
        self.d = c.decode("decode", "tcp")
        for x in (self.p, self.d):
            x.wait_healthy()
        self.n = 0

    def body(self, max_tokens: int = 4) -> dict[str, Any]:
        self.n += 1  # a prompt of its own: no prefix-cache hit on D, every block pulled
        return {"model": self.model, "prompt": f"{self.n} hostile {self.n} params",
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    def lease(self, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(self.p.url + "/v1/completions", timeout=30,
                       json={**body, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        return dict(r.json()["kv_transfer_params"])

    def decode(self, body: dict[str, Any], params: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.d.url + "/v1/completions", timeout=30,
                          json={**body, "kv_transfer_params": params})

    def pull_loads(self) -> None:
        """A genuine lease of P, pulled by D: 200, the KV loaded (one more completed
        pull), no fallback."""
        before = metrics(self.d.url)
        body = self.body()
        r = self.decode(body, self.lease(body))
        assert r.status_code == 200, r.text
        after = metrics(self.d.url)
        assert metric(after, "kvrelay_kv_load_fallbacks_total") == metric(
            before, "kvrelay_kv_load_fallbacks_total"), "the genuine pull fell back"
        assert metric(after, "kvrelay_kv_transfer_seconds_count") == metric(
            before, "kvrelay_kv_transfer_seconds_count") + 1, "the genuine pull loaded no KV"
        tcp = 'kvrelay_kv_transfers_total{transport="tcp"}'
        assert metric(after, tcp) == metric(before, tcp) + 1, "not counted as a tcp pull"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("decode-hostile-logs"))
    try:
        yield Pair(c, model.name)
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


def _error(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


@pytest.mark.parametrize("field", ["lease_id", "engine_id"])
def test_an_oversized_lease_field_is_a_400_and_the_next_pull_loads(pair: Pair,
                                                                   field: str) -> None:
    """Bug (issue 21): a 2 MiB lease_id (or engine_id) naming a real P's relay was
    admitted; D's ACQUIRE exceeded the frame limit, killed the sender thread, and every
    later genuine pull from that P fell back `unreachable` (5 of 5), D answering 200
    after a silent recompute. Now the field's bound is checked at admission."""
    body = pair.body()
    params = pair.lease(body)
    r = pair.decode(body, {**params, field: "x" * (2 << 20)})
    assert r.status_code == 400, r.text[:300]
    err = _error(r)
    assert err["param"] == "kv_transfer_params", err
    assert f"{field} has 2097152 characters; at most 300" in err["message"], err
    pair.pull_loads()
    pools_free(pair.d, prefill=(pair.p,), timeout=10.0)  # the unpulled lease: released


def _fds_and_threads(proc: Proc) -> tuple[int, int]:
    assert proc.proc is not None
    pid = proc.proc.pid
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_forty_spellings_of_one_relay_leave_fds_and_threads_flat(pair: Pair) -> None:
    """Bug (issue 21): D keyed its relay connections, sender threads and pooled data
    sockets by the relay as written: 40 spellings of one relay (h:05000, h:005000, ...)
    took D from 11 to 51 fds and from 5 to 85 threads (a control connection, a sender
    and a reader each, a pooled data socket left for ever). Now one relay is one key."""
    for _ in range(3):  # warm up: the one connection, sender, reader, pooled socket
        pair.pull_loads()
    fds0, threads0 = _fds_and_threads(pair.d)
    for i in range(40):
        body = pair.body()
        params = pair.lease(body)
        host, _, port = params["relay"].rpartition(":")
        params["relay"] = f"{host}:{'0' * (i + 1)}{port}"
        r = pair.decode(body, params)
        assert r.status_code == 200, r.text
    pair.pull_loads()
    fds, threads = _fds_and_threads(pair.d)
    # A little slack for what the HTTP server itself opens and closes meanwhile.
    assert fds <= fds0 + 3, f"D went from {fds0} to {fds} fds"
    assert threads <= threads0 + 3, f"D went from {threads0} to {threads} threads"


def test_clients_leaving_p_at_every_moment_leave_no_lease_to_expire(pair: Pair) -> None:
    """Bug (issue 21, abort storm): a client (the proxy, whose own client left) that
    went away just as P finished its prefill left a lease nobody released: the output
    that carried it reached a choice already counted as aborted and was dropped, or
    arrived after the handler had looked for leases. It was held until it expired.
    Now every lease made for a client that left is released at once (reason aborted)."""
    import json
    import random
    import socket
    import threading
    import time

    rng = random.Random(21)
    before = metrics(pair.p.url)

    host, port = pair.p.url.removeprefix("http://").split(":")

    def leave_after(seconds: float) -> None:
        """POST to P, then leave after ``seconds`` unless the answer is already there
        (a raw socket: whether the answer arrived is known to the byte, so a lease P
        did deliver is never taken for one it should have released)."""
        body = json.dumps({**pair.body(1), "kv_transfer_params": {"do_remote_decode": True}})
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(head.encode() + body.encode())
            time.sleep(seconds)  # the moment this client leaves: the fault, not a wait
            s.setblocking(False)
            try:
                answer = s.recv(1 << 20)
            except BlockingIOError:
                return  # nothing yet: gone (the socket closes here)
            s.setblocking(True)
            while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(
                    answer.lower().partition(b"content-length: ")[2].split(b"\r\n")[0]):
                answer += s.recv(1 << 20)
        # Answered in time: give the lease back as the proxy does when its client left.
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        params = json.loads(answer.partition(b"\r\n\r\n")[2])["kv_transfer_params"]
        r = httpx.post(pair.p.url + "/v1/kv/release", json={"kv_transfer_params": params},
                       timeout=10)
        assert r.status_code == 200, r.text
        answered.append(1)

    answered: list[int] = []
    # Leave at every moment of the prefill (a few ms on the tiny model), 4 at a time.
    delays = [rng.uniform(0.001, 0.08) for _ in range(120)]
    for i in range(0, len(delays), 4):
        threads = [threading.Thread(target=leave_after, args=(d,)) for d in delays[i:i + 4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    # The ledger: a lease expires only if P answered (counted remote_decode) a client
    # that had left just as the answer went out, which P cannot tell from a delivery;
    # never a lease of a request P itself saw leave (counted abort): that one is
    # released at once. Before the fix those were held until they expired.
    pools_free(pair.p, timeout=6.0)  # 3 lease timeouts: every lease settled
    after = metrics(pair.p.url)

    def delta(query: str) -> float:
        return metric(after, query) - metric(before, query)

    expired = delta('kvrelay_leases_released_total{reason="expired"}')
    answered_unseen = delta('kvrelay_requests_finished_total{reason="remote_decode"}') - sum(
        answered)
    assert expired <= answered_unseen, (
        f"{expired} leases expired, but P answered only {answered_unseen} clients that did "
        "not get the answer: a lease of a request P saw leave was left to expire")
    assert delta('kvrelay_leases_released_total{reason="aborted"}') > 0, \
        "no client left after its lease was made: the test tested nothing"


def test_a_relay_named_by_host_name_is_the_relay_of_its_address(pair: Pair) -> None:
    """Issue 21: relays are keyed by the resolved address. ``localhost:PORT`` and
    ``127.0.0.1:PORT`` were two relays to D (two connections, senders, pools and two of
    P's per-address slots); D now resolves the host at admission, off its event loop.
    A host that does not resolve is the client's 400."""
    pair.pull_loads()
    fds0, threads0 = _fds_and_threads(pair.d)
    for name in ("localhost", "LOCALHOST.", "127.0.0.1") * 3:
        body = pair.body()
        params = pair.lease(body)
        params["relay"] = f"{name}:{params['relay'].rpartition(':')[2]}"
        r = pair.decode(body, params)
        assert r.status_code == 200, r.text
    assert metric(metrics(pair.d.url), "kvrelay_relay_peers") == 1, "one relay, one sender"
    fds, threads = _fds_and_threads(pair.d)
    assert fds <= fds0 + 3, f"D went from {fds0} to {fds} fds"
    assert threads <= threads0 + 3, f"D went from {threads0} to {threads} threads"
    body = pair.body()
    params = pair.lease(body)
    r = pair.decode(body, {**params, "relay": "no-such-relay.invalid:5000"})
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == "kv_transfer_params" and "does not resolve" in err["message"], err
    pair.pull_loads()
    pools_free(pair.d, prefill=(pair.p,), timeout=10.0)  # the refused lease: released
