"""The proxy's view of an engine's cache from its KV events: keyed by tokens, bounded,
cleared or replayed on a sequence gap (real ZMQ sockets, one publisher in-process)."""

from __future__ import annotations

import asyncio
import queue
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvrelay.core.kv_events import Cleared, Removed, Stored
from kvrelay.proxy.affinity import Candidate, RoutingConfig, choose
from kvrelay.proxy.events import (
    EventMetrics,
    EventRecord,
    KvEventsFeed,
    Subscriber,
    reachable,
    token_chain,
)
from kvrelay.wire.kv_events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    KvEventsConfig,
    ZmqEventPublisher,
)

zmq = pytest.importorskip("zmq")
BS = 4


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def test_a_record_knows_blocks_by_their_tokens_and_forgets_removed_ones() -> None:
    r = EventRecord(100)
    prompt = list(range(20))  # 5 blocks
    r.apply([stored([b"h0", b"h1"], None, prompt[:8])])
    r.apply([stored([b"h2"], b"h1", prompt[8:12])])  # a child of a known block
    chain = token_chain(prompt, BS)
    assert r.match(chain) == 3 and len(r) == 3
    assert r.match(token_chain([99, *prompt[1:]], BS)) == 0  # other tokens: other keys
    r.apply([BlockRemoved(block_hashes=[b"h1"], medium="GPU")])
    assert r.match(chain) == 1  # a prefix stops at the first block missing
    r.apply([stored([b"h9"], b"unknown", prompt[12:16])])
    assert r.orphans == 1 and len(r) == 2  # its parent is unknown: it cannot be keyed
    r.insert(chain)  # the router's guess: nothing, with events
    assert len(r) == 2


def test_a_record_is_bounded_dropping_the_least_recently_stored() -> None:
    r = EventRecord(3)
    r.apply([stored([b"a", b"b"], None, list(range(8)))])
    r.apply([stored([b"c", b"d"], None, list(range(100, 108)))])
    assert len(r) == 3
    assert r.match(token_chain(list(range(8)), BS)) == 0  # "a" went first
    r.apply([BlockRemoved(block_hashes=[b"a"], medium="GPU")])  # unknown by now: fine
    assert len(r) == 3


def test_choose_reads_an_event_record_as_it_reads_a_guessed_one() -> None:
    class Up:
        def __init__(self, record: EventRecord) -> None:
            self.outstanding, self.healthy, self.prefixes = 0, True, record

    hot, cold = EventRecord(100), EventRecord(100)
    prompt = list(range(40))  # 10 blocks
    hot.apply([stored([bytes([i]) for i in range(6)], None, prompt[:24])])
    cfg = RoutingConfig(kv_events=True)
    chain = token_chain(prompt, BS)
    text_len = len(prompt) * cfg.chunk_chars // BS  # proxy_events.route_keys' units
    ups: list[Candidate] = [Up(cold), Up(hot)]  # type: ignore[list-item]
    up, reason = choose(ups, chain, text_len, cfg)
    assert up.prefixes is hot and reason.value == "prefix_match"
    up, reason = choose(ups, chain, text_len, RoutingConfig(kv_events=True,
                                                             cache_threshold=0.7))
    assert reason.value == "least_outstanding"  # 6 of 10 blocks is under 0.7
    with pytest.raises(ValueError, match="--kv-events"):
        RoutingConfig(policy="least-outstanding", kv_events=True)


def test_a_wildcard_endpoint_becomes_the_engines_host() -> None:
    assert reachable("tcp://0.0.0.0:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert reachable("tcp://*:5557", "fd00::1") == "tcp://[fd00::1]:5557"
    assert reachable("tcp://10.1.1.1:5557", "10.0.0.7") == "tcp://10.1.1.1:5557"
    assert reachable("ipc:///tmp/x", "10.0.0.7") == "ipc:///tmp/x"


def replay_all(endpoint: str, want: int) -> list[tuple[int, bytes]]:
    """Every batch the publisher kept, asked until ``want`` are there (each ask is a
    round trip to its thread)."""
    ctx = zmq.Context.instance()
    for _ in range(200):
        d = ctx.socket(zmq.DEALER)
        d.connect(endpoint)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while d.poll(5000):
            _, _, seq, payload = d.recv_multipart()
            if seq == END_SEQ:
                break
            got.append((int.from_bytes(seq, "big"), payload))
        d.close(linger=0)
        if len(got) >= want:
            return got
    raise AssertionError(f"the publisher never kept {want} batches")


def feed() -> KvEventsFeed:
    return KvEventsFeed(EventMetrics(CollectorRegistry()), 128)


def samples(f: KvEventsFeed, name: str) -> dict[str, float]:
    metric = getattr(f.metrics, name)
    return {"/".join(s.labels.values()): s.value for m in metric.collect()
            for s in m.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("with_replay", [True, False])
def test_a_sequence_gap_is_replayed_or_clears_the_view(tmp_path: Path,
                                                       with_replay: bool) -> None:
    pub = ZmqEventPublisher(KvEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay"))
    try:
        prompt = list(range(12))
        pub.offer([Stored((b"h0",), None, tuple(prompt[:4]), BS)])
        pub.offer([Stored((b"h1",), b"h0", tuple(prompt[4:8]), BS)])
        pub.offer([Stored((b"h2",), b"h1", tuple(prompt[8:12]), BS)])
        kept = replay_all(pub.replay_endpoint or "", 3)
        info: dict[str, Any] = {"endpoint": pub.endpoint,
                                "replay_endpoint": pub.replay_endpoint if with_replay else None}
        f, record = feed(), EventRecord(100)
        sub = Subscriber("http://127.0.0.1:1", info, record, f)
        ctx = zmq.Context.instance()
        sub._on_message([b"", (0).to_bytes(8, "big"), kept[0][1]], ctx)
        sub._on_message([b"", (2).to_bytes(8, "big"), kept[2][1]], ctx)  # 1 is missed
        chain = token_chain(prompt, BS)
        if with_replay:
            assert record.match(chain) == 3 and sub.last_seq == 2
            assert samples(f, "replays") == {"http://127.0.0.1:1": 1.0}
        else:  # cleared, then seq 2 applied: its parent is unknown, so nothing is known
            assert record.match(chain) == 0 and record.orphans == 1
            assert samples(f, "resets") == {"http://127.0.0.1:1/gap": 1.0}
        sub._on_message([b"", (0).to_bytes(8, "big"), kept[0][1]], ctx)  # a restart
        assert record.match(chain) == 1
    finally:
        pub.close()


def test_the_publisher_drops_a_batch_when_its_queue_is_full_and_then_clears() -> None:
    pub = ZmqEventPublisher.__new__(ZmqEventPublisher)  # the queue alone, no sockets
    pub._queue = queue.Queue(maxsize=1)
    pub._reset, pub.dropped_batches = False, 0
    pub.offer([Removed((b"a",))])
    pub.offer([Removed((b"b",))])  # full: dropped
    assert pub.dropped_batches == 1
    pub._queue.get_nowait()
    pub.offer([Removed((b"c",))])
    _, events = pub._queue.get_nowait()
    assert events == [Cleared(), Removed((b"c",))]


def test_route_keys_chains_a_token_prompt_and_tokenizes_a_text_one() -> None:
    class Leg:
        def __init__(self, prompt: Any) -> None:
            self.counts_prompt, self.body = True, {"prompt": prompt}
            self.chain: list[Any] = []
            self.text_len = 0

    asked: list[dict[str, Any]] = []

    async def tokenize(body: dict[str, Any]) -> list[int] | None:
        asked.append(body)
        return list(range(10))

    f = feed()
    legs = [Leg(list(range(8))), Leg("some text")]
    asyncio.run(f.route_keys(legs, False, tokenize))
    assert legs[0].chain == [] and not asked  # no block size known yet: no chain
    f.block_size = BS
    asyncio.run(f.route_keys(legs, False, tokenize))
    assert legs[0].chain == token_chain(list(range(8)), BS) and legs[0].text_len == 2 * 128
    assert asked == [{"prompt": "some text", "add_special_tokens": True}]
    assert len(legs[1].chain) == 2 and legs[1].text_len == 10 * 128 // BS
