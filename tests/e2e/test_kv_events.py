"""KV events for real: a served engine publishes vLLM-format events on ZMQ (a real SUB
reads BlockStored after a request, BlockRemoved after eviction, and the replay socket
answers), and the proxy routes by them (``--kv-events``): a prefix sent to one prefill
engine straight, never through the proxy, draws the proxy's next request with that
prefix to that engine; once the engine evicted it, no longer."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.proxy.events import reachable
from kvrelay.wire.kv_events import END_SEQ, BlockRemoved, BlockStored, decode_batch
from tests.e2e.cluster import Cluster, Proc, metric, metrics

zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                     "replay_endpoint": "tcp://*:0", "topic": "kv"})
SMALL = ("--num-blocks", "64", "--kv-events-config", EVENTS)  # 64 blocks of 4 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture
def cluster(model: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(model, tmp_path)
    try:
        yield c
    finally:
        c.close()
        print(c.logs())


@functools.cache
def served(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def complete(url: str, prompt: str | list[int], max_tokens: int = 1) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": served(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def text(i: int, words: int = 12) -> str:
    return " ".join(f"w{i}x{j}" for j in range(words))


def until(check: Callable[[], Any], what: str, tries: int = 200) -> Any:
    """``check()`` until it is truthy; each try waits on I/O (a socket poll, a request),
    so the bound counts events, not seconds."""
    for _ in range(tries):
        got = check()
        if got:
            return got
    raise AssertionError(f"never: {what}")


class Sub:
    """A plain SUB socket on an engine's advertised endpoint, as an external router has."""

    def __init__(self, engine: Proc) -> None:
        info = httpx.get(engine.url + "/v1/kv/events", timeout=5).json()
        assert info["format"] == "vllm" and info["topic"] == "kv"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(reachable(info["endpoint"], "127.0.0.1"))
        self.replay = reachable(info["replay_endpoint"], "127.0.0.1")
        self.seqs: list[int] = []
        self.events: list[Any] = []

    def poll(self, ms: int = 200) -> list[Any]:
        got = []
        while self.sock.poll(ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.seqs.append(int.from_bytes(seq, "big"))
            got.extend(decode_batch(payload).events)
            ms = 0
        self.events.extend(got)
        return got

    def replayed(self, start: int) -> list[int]:
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.replay)
        d.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while d.poll(5000):
            _, _topic, seq, _payload = d.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
        d.close(linger=0)
        return seqs

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def subscribed(sub: Sub, url: str) -> None:
    """Past ZMQ's slow joiner: distinct requests until one's events arrive."""
    n = iter(range(10_000, 20_000))
    until(lambda: complete(url, text(next(n))) and sub.poll(), "the SUB got a batch", 50)


def test_a_served_engine_publishes_stored_then_removed_with_the_prompts_tokens(
        cluster: Cluster) -> None:
    colo = cluster.colocated("colo", *SMALL).wait_healthy()
    sub = Sub(colo)
    try:
        subscribed(sub, colo.url)
        assert sub.replayed(0)[:1] == [0]  # seq 0: the new engine's AllBlocksCleared
        prompt = text(1, 20)
        tokens = httpx.post(colo.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        complete(colo.url, prompt)
        stored = until(lambda: [e for e in sub.poll() if isinstance(e, BlockStored)
                                and e.token_ids[:4] == tokens[:4]], "BlockStored")
        (ev,) = stored
        full = len(tokens) // 4
        assert ev.parent_block_hash is None and ev.block_size == 4 and ev.medium == "GPU"
        assert ev.token_ids == tokens[:full * 4] and len(ev.block_hashes) == full
        ours = set(ev.block_hashes)
        # 64 blocks: other prompts evict this one's (least recently used first).
        n = iter(range(100, 200))
        until(lambda: complete(colo.url, text(next(n), 10)) and any(
            isinstance(e, BlockRemoved) and ours & set(e.block_hashes) for e in sub.poll()),
            "BlockRemoved of the prompt's blocks", 60)
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
        assert sub.replayed(sub.seqs[-1]) == [sub.seqs[-1]]
    finally:
        sub.close()


def test_the_proxy_routes_by_the_engines_events_and_forgets_what_they_evicted(
        cluster: Cluster) -> None:
    pa = cluster.prefill("prefill-a", *SMALL)
    pb = cluster.prefill("prefill-b", *SMALL)
    d = cluster.decode("decode", "shm")  # publishes nothing: routed as an empty cache
    for e in (pa, pb, d):
        e.wait_healthy()
    proxy = cluster._proc("proxy", [
        "proxy", "--prefill", pa.url, pb.url, "--decode", d.url, "--health-interval", "0.2",
        "--kv-events"]).start().wait_healthy()

    def view(e: Proc) -> float:
        return metric(metrics(proxy.url), f'kvrelay_proxy_kv_event_blocks{{url="{e.url}"}}')

    def batches(e: Proc) -> float:
        return metric(metrics(proxy.url),
                      f'kvrelay_proxy_kv_event_batches_total{{url="{e.url}"}}')

    for e, base in ((pa, 20_000), (pb, 30_000)):  # each subscriber past the slow joiner
        n = iter(range(base, base + 100))
        until(lambda e=e, n=n: complete(e.url, text(next(n))) and batches(e), "subscribed")
    shared = text(7, 24)
    complete(pb.url, shared)  # straight to P-b: the proxy never sent it anywhere

    def in_sync(e: Proc) -> bool:  # at rest every published block is cached
        return view(e) == metric(metrics(e.url), "kvrelay_kv_blocks_cached") > 0

    until(lambda: in_sync(pb), "the proxy's view of P-b equals P-b's cache")
    hits = metric(metrics(pb.url), "kvrelay_prefix_cache_hits_total")
    complete(proxy.url, shared + " and then some", max_tokens=2)
    m = metrics(proxy.url)
    assert metric(m, 'kvrelay_proxy_route_total{role="prefill",reason="prefix_match"}') == 1
    assert metric(metrics(pb.url), "kvrelay_prefix_cache_hits_total") > hits
    # P-b evicts the prefix (other prompts, straight), and the proxy sees it go.
    for i in range(12):
        complete(pb.url, text(300 + i, 20))
    until(lambda: in_sync(pb), "the proxy's view of P-b after the evictions")
    complete(proxy.url, shared + " once more", max_tokens=2)
    m = metrics(proxy.url)
    assert metric(m, 'kvrelay_proxy_route_total{role="prefill",reason="prefix_match"}') == 1
    assert metric(m, 'kvrelay_proxy_kv_event_resets_total') == 0
