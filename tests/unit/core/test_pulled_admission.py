"""Admission of requests whose KV is pulled (decode side): they hold a sequence slot and
blocks from admission on, so they count against max_num_seqs and, for the blocks, against
the awaiting-KV block budget. Before, they counted against neither: under max_num_seqs 2,
6 pulled requests were admitted and the next batch ran 6, and forged params naming a dead
relay could pin any number of blocks until the peer timeout."""

from __future__ import annotations

import pytest

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import RequestState
from kvrelay.core.scheduler import KvQueueFull
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner, expected_output


def make(max_num_seqs: int = 256, num_blocks: int = 64,
         max_awaiting_kv_blocks: int | None = None,
         max_queued_kv_requests: int | None = None) -> Engine:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                          max_model_len=64, max_awaiting_kv_blocks=max_awaiting_kv_blocks,
                          max_queued_kv_requests=max_queued_kv_requests)
    return Engine(cfg, FakeRunner(block_size=4))


def pulled(engine: Engine, rid: str, prompt_len: int = 8, max_tokens: int = 4) -> None:
    engine.add_request(rid, [3] * prompt_len, SamplingParams(max_tokens=max_tokens, seed=1,
                                                             ignore_eos=True),
                       remote_kv={"lease_id": rid}, first_token=7)


def check_accounts(engine: Engine) -> None:
    engine.scheduler.check_accounts()
    engine.pool.check_integrity()


def test_six_pulled_requests_under_max_num_seqs_2_never_run_more_than_2() -> None:
    engine = make(max_num_seqs=2)
    for i in range(6):
        pulled(engine, f"r{i}")
    loaded: list[str] = []
    most = 0
    while engine.has_work():
        for req in engine.take_kv_waiting():  # the receiver's pull, done at once
            engine.kv_load_start(req.request_id)
            engine.kv_load_done(req.request_id)
            loaded.append(req.request_id)
        batch = engine.schedule()
        if batch is not None:
            most = max(most, len(batch.requests))
            engine.end_step(batch, engine.runner.execute(batch))
        else:
            engine.end_step(None)
        check_accounts(engine)
    assert most == 2 and loaded == [f"r{i}" for i in range(6)]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_pulled_and_local_requests_share_the_sequence_slots() -> None:
    engine = make(max_num_seqs=2)
    pulled(engine, "p0")
    pulled(engine, "p1")
    engine.add_request("local", [5] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.schedule() is None  # the two pulls hold both slots; nothing can run
    assert [r.request_id for r in engine.take_kv_waiting()] == ["p0", "p1"]
    assert engine.requests["local"].state is RequestState.WAITING
    engine.abort_request("p0")  # a pull that never comes: its slot goes back
    batch = engine.schedule()
    assert batch is not None and [r.request_id for r in batch.requests] == ["local"]
    check_accounts(engine)


def test_the_blocks_held_for_pulls_stay_within_their_budget() -> None:
    engine = make(num_blocks=64, max_awaiting_kv_blocks=8)
    for i in range(3):
        pulled(engine, f"r{i}", prompt_len=16)  # 4 blocks each
    engine.schedule()
    assert [r.request_id for r in engine.take_kv_waiting()] == ["r0", "r1"]
    assert engine.scheduler.awaiting_kv_blocks == 8 and engine.pool.num_free == 64 - 8
    engine.kv_load_start("r0")
    engine.kv_load_failed("r0", "the relay is unreachable", recompute=False)
    engine.schedule()  # r0's blocks are back: r2 fits in the budget
    assert [r.request_id for r in engine.take_kv_waiting()] == ["r2"]
    check_accounts(engine)


def test_a_pull_larger_than_the_budget_still_runs_alone() -> None:
    engine = make(num_blocks=64, max_awaiting_kv_blocks=2)
    pulled(engine, "big", prompt_len=20, max_tokens=3)  # 5 blocks
    pulled(engine, "next")
    engine.schedule()
    assert [r.request_id for r in engine.take_kv_waiting()] == ["big"]
    engine.kv_load_start("big")
    engine.kv_load_done("big")
    out: list[int] = []
    while engine.has_work():
        for req in engine.take_kv_waiting():
            engine.kv_load_start(req.request_id)
            engine.kv_load_done(req.request_id)
        out += [t for o in engine.step() if o.request_id == "big" for t in o.new_token_ids]
        check_accounts(engine)
    # The first token came from P; the fake runner's tokens follow it.
    assert out == expected_output(1, 21, 2, 1000)


def test_the_budget_is_validated() -> None:
    with pytest.raises(ValueError, match="max_awaiting_kv_blocks must be a positive integer"):
        SchedulerConfig(num_blocks=8, max_awaiting_kv_blocks=0)
    assert SchedulerConfig(num_blocks=9).awaiting_kv_block_budget == 4


def test_pulled_requests_beyond_the_queue_bound_are_refused_and_nothing_is_left() -> None:
    """Behind max_num_seqs 1 at most max_queued_kv_requests (2) pulled requests queue; the
    next is refused at once (KvQueueFull: HTTP 429) and leaves nothing in the engine; a
    slot freed lets the next one in. Local requests are never counted."""
    engine = make(max_num_seqs=1, max_queued_kv_requests=2)
    pulled(engine, "r0")
    engine.schedule()  # r0 admitted: it holds the slot, waiting for its KV
    pulled(engine, "r1")
    pulled(engine, "r2")
    engine.add_request("local", [5] * 8, SamplingParams(max_tokens=2))  # not counted
    with pytest.raises(KvQueueFull, match=r"2 requests whose KV is pulled are already "
                       r"queued on this decode engine \(max_queued_kv_requests 2\)"):
        pulled(engine, "r3")
    assert "r3" not in engine.requests and engine.scheduler.queued_kv == 2
    check_accounts(engine)
    engine.abort_request("r1")  # a queued one leaves: room for one more
    check_accounts(engine)
    pulled(engine, "r3")
    assert engine.scheduler.queued_kv == 2
    check_accounts(engine)


def test_the_queue_bound_defaults_to_four_times_max_num_seqs() -> None:
    assert SchedulerConfig(num_blocks=8, max_num_seqs=3).kv_queue_bound == 12
    assert SchedulerConfig(num_blocks=8, max_queued_kv_requests=5).kv_queue_bound == 5
    with pytest.raises(ValueError, match="max_queued_kv_requests must be a positive integer"):
        SchedulerConfig(num_blocks=8, max_queued_kv_requests=0)
