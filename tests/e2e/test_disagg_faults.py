"""Faults on a real disaggregated cluster: crashes, stops, disconnects, forged params.

One module-scoped cluster (a "fat" tiny model with ~64 KiB of KV per 4-token block so
that a long prompt's transfer can be interrupted): a colocated engine for reference
answers, one prefill engine, one decode engine (tcp, recompute policy) and a proxy.
Every test ends with both pools entirely free (after the 2 s lease deadline), no lease
held, and the survivors serving the next request through the proxy. Engines a test
kills are restarted on the same port so the proxy finds them again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import (
    Cluster,
    metric,
    metrics,
    poll,
    pools_free,
    sample,
    write_fat_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

LEASE_TIMEOUT = 2.0
FREE_WAIT = LEASE_TIMEOUT + 8.0
LONG = "ab " * 300  # ~600 tokens, ~150 blocks of 4
PULL = "ab " * 450  # ~900 tokens, ~225 blocks (~14 MiB): a pull long enough to catch
HUGE = "ba " + "ab " * 499  # ~1000 tokens; its head differs from LONG: no prefix hit


class Faults:
    def __init__(self, c: Cluster, model: str) -> None:
        self.c, self.model = c, model
        self.colo = c.colocated()
        self.p = c.prefill()
        self.d = c.decode("decode", "tcp", "--kv-load-failure-policy", "recompute")
        self.d_shm = c.decode("decode-shm", "shm")  # not behind the proxy
        for x in (self.colo, self.p, self.d, self.d_shm):
            x.wait_healthy()
        self.proxy = c.proxy([self.p], [self.d]).wait_healthy()

    def body(self, prompt: str | list[int], max_tokens: int = 6, **kw: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, **kw}

    def colocated_text(self, body: dict[str, Any]) -> str:
        r = httpx.post(self.colo.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    def prefill_direct(self, body: dict[str, Any]) -> dict[str, Any]:
        """P's kv_transfer_params; P's first-token text is kept in ``self.first_text``
        (D answers tokens 2..n: the proxy is the one that sends the first token)."""
        r = httpx.post(self.p.url + "/v1/completions", timeout=30,
                       json={**body, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert params["lease_id"] and params["block_ids"], params
        self.first_text = str(r.json()["choices"][0]["text"])
        return dict(params)

    def heal(self) -> None:
        """Restart whatever an earlier (failed) test left dead or stopped."""
        for name in ("p", "d", "d_shm"):
            proc = getattr(self, name)
            proc.signal(signal.SIGCONT) if proc.alive() else setattr(
                self, name, self.c.restart(proc))

    def decode_direct(self, body: dict[str, Any], params: dict[str, Any],
                      timeout: float = 30, d: Any = None) -> httpx.Response:
        """D's answer, params marked as kvrelay's proxy marks them: tokens 2..n."""
        d = d or self.d
        return httpx.post(d.url + "/v1/completions", timeout=timeout,
                          json={**body, "kv_transfer_params": {**params,
                                                               "first_token_sent": True}})

    def wait_proxy_sees(self, timeout: float = 10.0) -> None:
        """After a restart: the proxy's health loop must have found the engine again."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.serves()
                return
            except AssertionError:
                assert time.monotonic() < deadline, "proxy does not serve after a restart"
                time.sleep(0.25)

    def serves(self) -> None:
        body = self.body("The survivors still serve", 5)
        r = httpx.post(self.proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == self.colocated_text(body)

    def free(self) -> None:
        pools_free(self.d, prefill=(self.p,), timeout=FREE_WAIT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    model = write_fat_model(tmp_path_factory.mktemp("fat") / "fat")
    # Every pull waits 0.3 s before it writes (fault injection), so the tests can act
    # while a lease is PULLING: kill D, or close the client, mid-transfer.
    c = Cluster(model, tmp_path_factory.mktemp("disagg-fault-logs"),
                extra_env={"KVRELAY_FAULT_TRANSFER_DELAY_S": "0.3"})
    try:
        faults = Faults(c, model.name)
        yield faults
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


@pytest.fixture
def f(cluster: Faults) -> Faults:
    cluster.heal()
    return cluster


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_kill_decode_during_transfer(f: Faults, transport: str) -> None:
    """kill -9 D while P's lease is PULLING: P frees the blocks at the lease deadline,
    a restarted D serves (through the proxy for tcp, directly for shm)."""
    attr = "d" if transport == "tcp" else "d_shm"
    d = getattr(f, attr)
    caught = False
    for attempt in range(12):
        body = f.body(PULL + str(attempt), 4)
        params = f.prefill_direct(body)
        t = threading.Thread(target=_swallow, args=(f.decode_direct, body, params, 10, d),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and t.is_alive():
            if pulling(f.p):
                d.kill()  # SIGKILL
                caught = True
                break
        t.join(15)
        if caught:
            break
    assert caught, "never saw a lease in state pulling to kill D during"
    m0 = released(f.p)
    pools_free(prefill=(f.p,), timeout=FREE_WAIT)
    m1 = released(f.p)
    delta = {k: m1[k] - m0[k] for k in m1}
    print(f"kill D ({transport}) mid-pull:", delta)
    assert sum(delta.values()) >= 1, "the lease was not released after D died"
    d = f.c.restart(d)
    setattr(f, attr, d)
    body = f.body("A new decode engine serves", 6)
    params = f.prefill_direct(body)
    bytes0 = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total")
    r = f.decode_direct(body, params, d=d)
    assert r.status_code == 200, r.text
    assert f.first_text + r.json()["choices"][0]["text"] == f.colocated_text(body)
    assert metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > bytes0
    f.wait_proxy_sees()
    pools_free(d, f.d, prefill=(f.p,), timeout=FREE_WAIT)


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("kvrelay-")}
    except OSError:
        return set()


def _swallow(fn: Any, *args: Any) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn(*args)


def test_kill_prefill_after_answer_decode_recomputes(f: Faults) -> None:
    body = f.body("Prefill dies after answering", 8)
    want = f.colocated_text(body)
    params = f.prefill_direct(body)
    segments = shm_segments()
    assert segments, "P (--kv-transport auto) has no kvrelay-* segment in /dev/shm"
    f.p.kill()
    r = f.decode_direct(body, params)
    assert r.status_code == 200, r.text
    assert f.first_text + r.json()["choices"][0]["text"] == want
    m = metrics(f.d.url)
    assert metric(m, "kvrelay_kv_load_fallbacks_total") >= 1, m
    pools_free(f.d, timeout=FREE_WAIT)
    # P's KV cache was a shared-memory segment: a SIGKILL must not leak it in /dev/shm.
    deadline = time.monotonic() + 5
    while not segments - shm_segments() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert segments - shm_segments(), f"P's segment was not removed: {segments}"
    f.p = f.c.restart(f.p)
    f.wait_proxy_sees()
    f.free()


def pulling(p: Any) -> bool:
    return sample(metrics(p.url), "kvrelay_leases", state="pulling") > 0


def caught_pulling(f: Any, t: threading.Thread, timeout: float = 30) -> bool:
    """Wait until P's lease is PULLING (each pull waits 0.3 s before it writes) while
    the decode request ``t`` runs; False when the pull ended before it was seen."""
    deadline = time.monotonic() + timeout
    while t.is_alive() and time.monotonic() < deadline:
        if pulling(f.p):
            return True
        time.sleep(0.01)
    return False


def start_a_caught_pull(f: Any, prompt: str, **kw: Any) -> tuple[
        str, str, list[httpx.Response], threading.Thread]:
    """Start D's request for a fresh prompt (``prompt`` and an attempt number) on a thread
    and return once P's lease was seen PULLING: (the colocated text, P's first text, the
    list D's response lands in, the thread). A pull that ended before it was seen (a busy
    machine) is tried again with a new prompt."""
    for attempt in range(8):
        body = f.body(f"{prompt} {attempt}", 4)
        want = f.colocated_text(body)
        params = f.prefill_direct(body)
        first_text = f.first_text
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda b=body, p=params, out=result: out.append(
            f.decode_direct(b, p, **kw)), daemon=True)
        t.start()
        if caught_pulling(f, t):
            return want, first_text, result, t
        t.join(60)
    pytest.fail("never saw the lease pulling in 8 attempts")


def _stream_and_close(url: str, body: dict[str, Any], after_chunks: int,
                      until: Any = None) -> int:
    """Stream a completion and close the connection after ``after_chunks`` data lines
    (and, with ``until``, once until() is true, polled for at most 3 s). Returns the
    number of chunks read, negative when ``until`` never became true."""
    n = 0
    with httpx.Client(timeout=30) as cl, cl.stream("POST", url + "/v1/completions",
                                                    json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                n += 1
                if n >= after_chunks:
                    deadline = time.monotonic() + 3
                    while until is not None and not until():
                        if time.monotonic() > deadline:
                            return -n
                    break
    return n


@pytest.mark.parametrize("stage", ["waiting_for_prefill", "between_prefill_and_decode",
                                   "during_pull", "during_decode"])
def test_client_disconnect(f: Faults, stage: str) -> None:
    before = released(f.p)
    if stage == "waiting_for_prefill":
        _give_up_while_waiting_for_prefill(f)
    elif stage == "between_prefill_and_decode":
        # The proxy streams P's first token at once: close right after it.
        for i in range(3):
            _stream_and_close(f.proxy.url, f.body(f"short {i}", 50), 1)
    elif stage == "during_pull":
        # Close once P shows the lease PULLING (D is copying it).
        caught = [_stream_and_close(f.proxy.url, f.body(LONG + str(i), 50), 1,
                                    until=lambda: pulling(f.p)) > 0 for i in range(4)]
        assert any(caught), "never caught a lease in state pulling"
    else:
        assert _stream_and_close(f.proxy.url, f.body("decode a while", 200), 3) == 3
    f.free()
    after = released(f.p)
    delta = {k: after[k] - before[k] for k in after}
    print(stage, delta)
    # A disconnect is reported (proxy release or D abort), never left to the deadline.
    assert delta["expired"] == 0, delta
    f.serves()


def _give_up_while_waiting_for_prefill(f: Faults) -> None:
    """A blocker holds most of P's KV pool, so three huge prompts cannot be admitted:
    they wait in P's queue while their clients give up. The proxy must cancel them on
    P: P's queue empties while the blocker still runs, they end as aborts, and no
    first token is sampled and no lease made for them (asserted by the caller too:
    no lease expired)."""
    p0 = metrics(f.p.url)
    stop, started = threading.Event(), threading.Event()
    blocker = threading.Thread(target=_hold_stream, daemon=True,
                               args=(f.p.url, f.body(LONG, 400), started, stop))
    blocker.start()
    try:
        assert started.wait(30), "the blocker never started"
        t0 = time.monotonic()
        url = f.proxy.url + "/v1/completions"
        clients = [threading.Thread(target=_swallow, args=(
            lambda b: httpx.post(url, json=b, timeout=0.3), f.body(HUGE + str(i), 4)))
            for i in range(3)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(10)
        def queued() -> float:
            return sample(metrics(f.p.url), "kvrelay_requests_waiting")

        poll(lambda: not blocker.is_alive() or queued() == 0, 10)
        print(f"P's queue: {queued()} after {time.monotonic() - t0:.2f} s")
        assert blocker.is_alive(), "P still queued the prefills of clients that had left " \
            "when the blocker ended: the proxy did not cancel them"
    finally:
        stop.set()
        blocker.join(30)
    f.free()
    p1 = metrics(f.p.url)

    def delta(reason: str) -> float:
        return (sample(p1, "kvrelay_requests_finished_total", reason=reason)
                - sample(p0, "kvrelay_requests_finished_total", reason=reason))

    assert delta("abort") == 4, "the three prefills and the blocker end as aborts on P"
    assert delta("remote_decode") == 0, "P prefilled for a client that had left"


def _hold_stream(url: str, body: dict[str, Any], started: threading.Event,
                 stop: threading.Event) -> None:
    """Stream a completion from ``url`` until ``stop`` (the request holds its blocks)."""
    with httpx.Client(timeout=60) as cl, cl.stream("POST", url + "/v1/completions",
                                                    json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                started.set()
                if stop.is_set():
                    return


def test_decode_dies_mid_stream_ends_with_an_error_event(f: Faults) -> None:
    """kill -9 D while it streams through the proxy: the client gets an error event and
    [DONE], never a stream cut short without a word."""
    events: list[str] = []
    body = {**f.body("decode a while", 200), "stream": True}
    with httpx.stream("POST", f.proxy.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if len(events) == 3:
                    f.d.kill()
    assert events[-1] == "[DONE]", events[-3:]
    assert "error" in json.loads(events[-2]), events[-3:]
    assert len(events) < 150, "D was not killed mid-stream"
    f.d = f.c.restart(f.d)
    f.wait_proxy_sees()
    f.free()


def test_prefill_stopped_decode_falls_back(f: Faults) -> None:
    """SIGSTOP P after it answered: D's pull times out, it recomputes, the client gets
    the colocated answer; after SIGCONT P's lease expires and both pools are free."""
    body = f.body("The prefill engine is frozen", 8)
    want = f.colocated_text(body)
    params = f.prefill_direct(body)
    fb0 = metric(metrics(f.d.url), "kvrelay_kv_load_fallbacks_total")
    f.p.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = f.decode_direct(body, params, timeout=LEASE_TIMEOUT * 5 + 10)
        took = time.monotonic() - t0
    finally:
        f.p.signal(signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert f.first_text + r.json()["choices"][0]["text"] == want
    assert took < LEASE_TIMEOUT * 5 + 5
    assert metric(metrics(f.d.url), "kvrelay_kv_load_fallbacks_total") == fb0 + 1
    f.free()
    f.serves()


def released(p: Any) -> dict[str, float]:
    """P's released leases by reason."""
    m = metrics(p.url)
    return {r: sample(m, "kvrelay_leases_released_total", reason=r)
            for r in ("done", "failed", "aborted", "expired")}


def _error_param(r: httpx.Response) -> Any:
    try:
        return r.json()["error"].get("param")
    except (ValueError, KeyError, AttributeError):
        return None


FORGERIES = {
    "wrong lease id": lambda mine, other: {**mine, "lease_id": secrets.token_hex(16)},
    "someone else's block ids": lambda mine, other: {**mine, "block_ids": other["block_ids"]},
    "wrong compat": lambda mine, other: {**mine, "compat": "0" * len(mine["compat"])},
    "wrong first token": lambda mine, other: {**mine,
                                              "first_token": (mine["first_token"] + 1) % 200},
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_params_are_rejected_without_reading(f: Faults, forgery: str) -> None:
    """Each forgery on a fresh, genuine lease of its own (so that no earlier rejection
    released it): D answers 4xx, error.param == "kv_transfer_params", reads no byte."""
    body = f.body("Forged transfer parameters", 6)
    want = f.colocated_text(body)
    other = f.prefill_direct(f.body(LONG, 6))
    mine = f.prefill_direct(body)
    bytes0 = metric(metrics(f.d.url), "kvrelay_kv_transfer_bytes_total")
    r = f.decode_direct(body, FORGERIES[forgery](mine, other))
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert _error_param(r) == "kv_transfer_params", r.text
    assert metric(metrics(f.d.url), "kvrelay_kv_transfer_bytes_total") == bytes0, \
        "D read KV for forged params"
    # The genuine params still get the colocated answer (pulled, or recomputed when the
    # rejection released the lease).
    r = f.decode_direct(body, mine)
    assert r.status_code == 200, r.text
    assert f.first_text + r.json()["choices"][0]["text"] == want
    f.free()


def test_replayed_params_never_read(f: Faults) -> None:
    """Params already used: P answers that the lease was released after a pull (done);
    D refuses with a 400 naming kv_transfer_params and reads nothing."""
    body = f.body("Replay me", 6)
    want = f.colocated_text(body)
    params = f.prefill_direct(body)
    r = f.decode_direct(body, params)
    assert r.status_code == 200, r.text
    assert f.first_text + r.json()["choices"][0]["text"] == want
    f.free()
    m0d, m0p = metrics(f.d.url), metrics(f.p.url)
    r = f.decode_direct(body, params)
    assert r.status_code == 400 and _error_param(r) == "kv_transfer_params", r.text
    m1d, m1p = metrics(f.d.url), metrics(f.p.url)
    assert metric(m1d, "kvrelay_kv_transfer_bytes_total") == metric(
        m0d, "kvrelay_kv_transfer_bytes_total"), "a replay moved KV bytes"
    assert metric(m1p, "kvrelay_relay_stale_messages_total") > metric(
        m0p, "kvrelay_relay_stale_messages_total"), "P did not count the replay as stale"
    f.free()
    f.serves()


def _concurrently(*calls: Any) -> list[httpx.Response]:
    out: list[Any] = [None] * len(calls)

    def run(i: int, fn: Any, *args: Any) -> None:
        out[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("target", ["same D over tcp", "same D over shm", "another D"])
def test_concurrent_replay_never_decodes_on_reused_kv(f: Faults, target: str) -> None:
    """Bug (issue 9): the same params sent twice to one decode engine, the second while
    the first pull was in progress, were treated as a duplicate of the first attempt;
    over shm the second copied after P had freed and reused the blocks and decoded
    wrong text with a 200. A lease is now a capability of one attempt: one request
    pulls and answers the colocated text, the other gets a 400 naming
    kv_transfer_params, and both pools are free after."""
    body = f.body(LONG + target, 6)
    want = f.colocated_text(body)
    params = f.prefill_direct(body)
    first_text = f.first_text  # the churn below overwrites it
    first, second = {"same D over tcp": (f.d, f.d), "same D over shm": (f.d_shm, f.d_shm),
                     "another D": (f.d, f.d_shm)}[target]
    # P keeps prefilling meanwhile, so freed blocks would be reused at once.
    churn = [(f.prefill_direct, f.body(f"churn {i}", 2)) for i in range(3)]
    rs = _concurrently((f.decode_direct, body, params, 30, first),
                       (f.decode_direct, body, params, 30, second), *churn)[:2]
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 400], [(r.status_code, r.text[:200]) for r in rs]
    ok = next(r for r in rs if r.status_code == 200)
    bad = next(r for r in rs if r.status_code == 400)
    assert first_text + ok.json()["choices"][0]["text"] == want
    assert _error_param(bad) == "kv_transfer_params", bad.text
    pools_free(f.d, f.d_shm, prefill=(f.p,), timeout=FREE_WAIT)


def test_forged_first_token_with_an_unreachable_relay_is_a_400(f: Faults) -> None:
    """Bug (issue 9): params whose relay was unreachable and whose first token was
    outside the vocabulary made D recompute, then IndexError in the engine loop: the
    loop died, /health stayed 503. They are now validated before admission."""
    body = f.body("A forged first token", 4)
    params = {**f.prefill_direct(body), "relay": "127.0.0.1:1", "first_token": 10**6}
    r = f.decode_direct(body, params)
    assert r.status_code == 400 and _error_param(r) == "kv_transfer_params", r.text
    assert "first_token" in r.json()["error"]["message"]
    assert httpx.get(f.d.url + "/health", timeout=5).status_code == 200
    f.free()
    f.serves()


def test_prefill_frozen_mid_copy_decode_falls_back_within_the_lease_timeout(f: Faults) -> None:
    """Bug (issue 9): the data socket had no timeout, so a P frozen mid-copy held D for
    --lease-max. Now every wait of the pull is bounded by the lease timeout: D falls
    back (recompute) and answers the colocated text."""
    want, _, result, t = start_a_caught_pull(f, f"{PULL} frozen", timeout=60)
    f.p.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        t.join(LEASE_TIMEOUT * 4 + 20)
        took = time.monotonic() - t0
    finally:
        f.p.signal(signal.SIGCONT)
    assert result, "D did not answer while P was frozen"
    r = result[0]
    assert r.status_code == 200, r.text
    assert f.first_text + r.json()["choices"][0]["text"] == want
    print(f"frozen P mid-copy: D answered {took:.1f} s after the freeze")
    assert took < LEASE_TIMEOUT * 4 + 10  # the recompute included; --lease-max is 480 s
    f.free()
    f.serves()


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return metric(after, name) - metric(before, name)


def test_a_partial_pull_moves_only_the_blocks_d_lacks(f: Faults) -> None:
    """Issue 13: D shares the prompt blocks its own prefix cache holds and pulls only the
    rest; P releases the skipped blocks at ACQUIRE (its counter matches D's), the bytes
    moved are exactly the missing blocks', and the text is the colocated one."""
    head = f"{secrets.token_hex(3)} " + "cd ef " * 60  # unique: nothing cached before
    per_block = 0.0
    for i, tail in enumerate(("first tail", "second tail")):
        body = f.body(head + tail, 4)
        want = f.colocated_text(body)
        params = f.prefill_direct(body)
        d0, p0 = metrics(f.d.url), metrics(f.p.url)
        r = f.decode_direct(body, params)
        assert r.status_code == 200, r.text
        assert f.first_text + r.json()["choices"][0]["text"] == want
        d1, p1 = metrics(f.d.url), metrics(f.p.url)
        moved = _delta(d1, d0, "kvrelay_kv_transfer_bytes_total")
        skipped = _delta(d1, d0, "kvrelay_kv_pull_skipped_blocks_total")
        assert skipped == _delta(p1, p0, "kvrelay_kv_pull_skipped_blocks_total")
        n = len(params["block_ids"])
        if i == 0:
            assert skipped == 0 and moved > 0
            per_block = moved / n
        else:
            assert n - 4 <= skipped < n, (skipped, n)  # all but the differing tail
            assert moved == (n - skipped) * per_block
    f.free()
    f.serves()


def test_eviction_on_d_while_a_partial_pull_is_in_flight(f: Faults) -> None:
    """Issue 13: while a partial pull waits for its tail (each pull here waits 0.3 s
    before writing), a local request on D needs more blocks than are free: D evicts
    cached blocks, never the prefix the pulling request shares, so the pulled request
    still answers the colocated text and every block is free or cached after."""
    head = f"{secrets.token_hex(3)} " + "gh ij " * 60
    warm = f.body(head + "warm", 2)
    r = f.decode_direct(warm, f.prefill_direct(warm))
    assert r.status_code == 200, r.text
    filler = f.body(f"{secrets.token_hex(3)} " + "kl " * 100, 1)  # cached blocks on D
    assert httpx.post(f.d.url + "/v1/completions", json=filler, timeout=30).status_code == 200
    want, first_text, result, t = start_a_caught_pull(f, head + "pulled")
    m = metrics(f.d.url)
    free, cached = metric(m, "kvrelay_kv_blocks_free"), metric(m, "kvrelay_kv_blocks_cached")
    assert cached >= 2, (free, cached)
    # A prompt of token ids that needs every free block and half the cached ones.
    need = int(free + cached // 2)
    hog = f.body([7] * (need * 4 - 2), 1)
    r = httpx.post(f.d.url + "/v1/completions", json=hog, timeout=30)
    assert r.status_code == 200, r.text
    t.join(30)
    assert result and result[0].status_code == 200, result and result[0].text
    assert first_text + result[0].json()["choices"][0]["text"] == want
    assert _delta(metrics(f.d.url), m, "kvrelay_prefix_cache_evictions_total") > 0
    f.free()
    f.serves()
