"""The core's KV-event record: what the prefix cache publishes and evicts, bounded."""

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.kv_events import Cleared, KvEventLog, Removed, Stored
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner

BS = 4


def make(num_blocks: int = 8) -> Engine:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=64,
                          max_model_len=32, enable_prefix_caching=True)
    engine = Engine(cfg, runner=FakeRunner())
    engine.runner = FakeRunner(block_size=BS, pool=engine.pool, check_kv=True)
    return engine


def run(engine: Engine, rid: str, prompt: list[int], max_tokens: int = 1) -> None:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_work():
        engine.step()


def test_a_new_record_starts_cleared_and_stores_a_prompts_full_blocks_as_one_event() -> None:
    engine = make()
    engine.record_kv_events(64)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks of 4, 2 left over
    run(engine, "a", prompt)
    events = engine.take_kv_events()
    assert isinstance(events[0], Cleared)
    stored = [e for e in events if isinstance(e, Stored)]
    assert len(stored) == 1
    s = stored[0]
    assert s.parent_block_hash is None and s.block_size == BS
    assert s.token_ids == tuple(prompt[:8])
    # The hashes are the pool's own: each one finds its published block.
    assert len(engine.pool.match(s.block_hashes)) == 2
    assert engine.take_kv_events() == []  # taken: the record is empty


def test_a_longer_prompt_with_a_cached_prefix_stores_only_its_new_blocks_after_its_parent(
) -> None:
    engine = make()
    engine.record_kv_events(64)
    run(engine, "a", list(range(10, 19)))  # blocks 0, 1
    (first,) = [e for e in engine.take_kv_events() if isinstance(e, Stored)]
    run(engine, "b", list(range(10, 23)))  # blocks 0, 1 hit; block 2 new
    (second,) = [e for e in engine.take_kv_events() if isinstance(e, Stored)]
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == tuple(range(18, 22))


def test_eviction_records_the_removed_hash() -> None:
    engine = make(num_blocks=4)  # 3 blocks a prompt: the second evicts the first's
    engine.record_kv_events(64)
    run(engine, "a", list(range(10, 19)))
    (stored,) = [e for e in engine.take_kv_events() if isinstance(e, Stored)]
    run(engine, "b", list(range(50, 59)))
    events = engine.take_kv_events()
    removed = {h for e in events if isinstance(e, Removed) for h in e.block_hashes}
    assert removed and removed <= set(stored.block_hashes)
    assert not engine.pool.match([h for h in stored.block_hashes if h in removed][:1])


def test_two_requests_with_one_prefix_in_one_step_announce_each_block_once() -> None:
    engine = make(num_blocks=16)
    engine.record_kv_events(64)
    p = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request("a", list(range(10, 19)), p)
    engine.add_request("b", list(range(10, 19)), p)  # same prefix, no hit yet
    while engine.has_work():
        engine.step()
    announced = [h for e in engine.take_kv_events() if isinstance(e, Stored)
                 for h in e.block_hashes]
    assert len(announced) == len(set(announced)) == 2


def test_not_recording_records_nothing() -> None:
    engine = make()
    run(engine, "a", list(range(10, 19)))
    assert engine.pool.events is None and engine.take_kv_events() == []


def test_a_full_record_drops_the_oldest_counts_them_and_the_next_take_starts_cleared() -> None:
    log = KvEventLog(2)
    assert log.take() == [Cleared()]
    log.removed(b"a")
    log.removed(b"b")
    log.removed(b"c")
    assert log.dropped == 1
    assert log.take() == [Cleared(), Removed((b"b",)), Removed((b"c",))]
    log.removed(b"d")
    assert log.take() == [Removed((b"d",))]


def test_replaying_the_events_gives_exactly_the_pools_published_blocks() -> None:
    """What a consumer builds from the events equals the prefix cache, after every step,
    under eviction, shared prefixes and aborts."""
    import random

    rng = random.Random(7)
    engine = make(num_blocks=12)
    engine.record_kv_events(1000)
    known: set[bytes] = set()
    prefixes = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    for i in range(60):
        if rng.random() < 0.6:
            tail = [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
            engine.add_request(f"r{i}", rng.choice(prefixes) + tail,
                               SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True))
        if engine.requests and rng.random() < 0.1:
            engine.abort_request(rng.choice(list(engine.requests)))
        if engine.has_work():
            engine.step()
        for e in engine.take_kv_events():
            if isinstance(e, Cleared):
                known.clear()
            elif isinstance(e, Stored):
                assert not known & set(e.block_hashes)  # announced once while cached
                known |= set(e.block_hashes)
            else:
                known -= set(e.block_hashes)
        assert known == set(engine.pool._by_hash)
    assert engine.pool.num_evictions > 0
