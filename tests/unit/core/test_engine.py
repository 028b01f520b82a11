from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import lease_owner
from kvrelay.core.engine import Engine, RequestOutput
from kvrelay.core.lifecycle import FinishReason, RequestState
from kvrelay.core.request import Request
from kvrelay.core.runner import PLACEHOLDER
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner, expected_output


def make(async_scheduling: bool = False, num_blocks: int = 32) -> Engine:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64,
                          max_model_len=128, async_scheduling=async_scheduling)
    engine = Engine(cfg, runner=FakeRunner())
    engine.runner = FakeRunner(block_size=4, pool=engine.pool, check_kv=True)
    return engine


def params(max_tokens: int = 8, seed: int = 0, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos)


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_generates_the_fake_runners_tokens_sync_and_async() -> None:
    for async_scheduling in (False, True):
        engine = make(async_scheduling)
        for i in range(5):
            engine.add_request(f"r{i}", [5] * (3 + i), params(seed=i))
        outs = run(engine)
        for i in range(5):
            assert tokens(outs[f"r{i}"]) == expected_output(i, 3 + i, 8, 1000)
            assert [o.finished for o in outs[f"r{i}"]].count(True) == 1
            assert outs[f"r{i}"][-1].finish_reason is FinishReason.LENGTH
        assert engine.pool.num_free == engine.pool.num_blocks


def test_eos_stops_unless_ignored() -> None:
    engine = make()
    first = expected_output(3, 4, 1, 1000)[0]
    engine.add_request("a", [1] * 4, params(seed=3, ignore_eos=False), eos_token_ids=[first])
    engine.add_request("b", [1] * 4, params(seed=3, ignore_eos=True), eos_token_ids=[first])
    outs = run(engine)
    assert tokens(outs["a"]) == [first] and outs["a"][-1].finish_reason is FinishReason.STOP
    assert len(tokens(outs["b"])) == 8


def test_abort_inside_an_in_flight_step_keeps_blocks_until_it_completes() -> None:
    engine = make()
    req = engine.add_request("a", [1] * 6, params())
    batch = engine.schedule()
    assert batch is not None and req.in_flight == 1
    blocks = list(req.block_ids)
    assert engine.abort_request("a")
    # Terminal output at once, blocks still owned: the step may still write them.
    [out] = engine.take_outputs()
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert req.state is RequestState.FINISHING
    assert all(engine.pool.owner_of(b) == "req:a" for b in blocks)
    engine.complete(batch, engine.runner.execute(batch))
    assert req.state is RequestState.FINISHED and engine.pool.num_free == engine.pool.num_blocks
    assert engine.take_outputs() == []  # the step's sample was dropped
    assert engine.stats.dropped_samples == 1
    assert not engine.has_work()


def test_terminal_is_terminal() -> None:
    engine = make()
    engine.add_request("a", [1, 2], params())
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert not engine.abort_request("never-existed")
    assert engine.stats.stale_events == 2
    assert [o.finished for o in engine.take_outputs()] == [True]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_async_finish_drops_the_next_steps_sample_and_uses_placeholders() -> None:
    engine = make(async_scheduling=True)
    engine.add_request("a", [1] * 3, params(max_tokens=3))
    engine.add_request("b", [1] * 3, params(max_tokens=6))
    seen_placeholder = False
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        batch = engine.schedule()
        if batch is not None:
            seen_placeholder |= any(PLACEHOLDER in r.token_ids for r in batch.requests)
            engine._in_flight.append((batch, engine.runner.execute(batch)))
        if len(engine._in_flight) > 1 or (batch is None and engine._in_flight):
            engine.complete(*engine._in_flight.popleft())
        for out in engine.take_outputs():
            outs.setdefault(out.request_id, []).append(out)
    assert seen_placeholder
    assert tokens(outs["a"]) == expected_output(0, 3, 3, 1000)
    assert tokens(outs["b"]) == expected_output(0, 3, 6, 1000)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_abort_during_async_pipeline_at_every_step() -> None:
    for abort_at in range(8):
        engine = make(async_scheduling=True)
        engine.add_request("a", [1] * 5, params(max_tokens=6))
        engine.add_request("b", [1] * 5, params(max_tokens=6, seed=1))
        outs: dict[str, list[RequestOutput]] = {}
        step = 0
        while engine.has_work():
            if step == abort_at:
                engine.abort_request("a")
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
            engine.pool.check_integrity()
            step += 1
        assert [o.finished for o in outs["a"]].count(True) == 1
        assert tokens(outs["a"]) == expected_output(0, 5, 6, 1000)[: len(tokens(outs["a"]))]
        assert tokens(outs["b"]) == expected_output(1, 5, 6, 1000)
        assert engine.pool.num_free == engine.pool.num_blocks


def test_engine_keeps_stepping_while_only_pending_releases_remain() -> None:
    engine = make(async_scheduling=True)
    engine.add_request("a", [1] * 4, params())
    engine.step()  # step 0 in flight
    engine.abort_request("a")
    assert engine.has_work()  # only a FINISHING request with an in-flight step remains
    engine.step()
    assert not engine.has_work() and engine.pool.num_free == engine.pool.num_blocks


def test_remote_decode_hands_blocks_to_a_lease_after_the_fence() -> None:
    engine = make(async_scheduling=True)
    handed: list[tuple[str, list[int]]] = []

    def handoff(req: Request) -> None:
        owner = lease_owner(req.request_id)
        engine.pool.transfer(req.block_ids, req.owner, owner)
        handed.append((owner, list(req.block_ids)))

    engine.kv_handoff = handoff
    engine.add_request("p", [1] * 9, params(max_tokens=1), remote_decode=True)
    outs = run(engine)
    assert outs["p"][-1].finish_reason is FinishReason.REMOTE_DECODE
    assert tokens(outs["p"]) == expected_output(0, 9, 1, 1000)
    [(owner, blocks)] = handed
    assert len(blocks) == 3 and engine.pool.owned_count(owner) == 3
    engine.pool.free(blocks, owner)
    engine.pool.check_integrity()
