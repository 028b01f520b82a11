import pytest

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import RequestState
from kvrelay.core.scheduler import RequestRejected
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner, expected_output


def make(num_blocks: int = 64, block_size: int = 4, **kw: int) -> Engine:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kw)  # type: ignore[arg-type]
    engine = Engine(cfg, runner=FakeRunner(block_size=block_size))
    engine.runner = FakeRunner(block_size=block_size, pool=engine.pool, check_kv=True)
    return engine


def add(engine: Engine, rid: str, prompt_len: int, max_tokens: int = 4, seed: int = 0) -> None:
    engine.add_request(rid, list(range(1, prompt_len + 1)), SamplingParams(
        max_tokens=max_tokens, seed=seed, ignore_eos=True))


def test_token_budget_chunks_long_prompts_fcfs() -> None:
    engine = make(max_num_batched_tokens=16)
    for rid in ("a", "b", "c"):
        add(engine, rid, 10)
    batch = engine.scheduler.schedule()
    assert [(r.request_id, r.start, len(r.token_ids), r.sample) for r in batch.requests] == [
        ("a", 0, 10, True),
        ("b", 0, 6, False),  # chunked: the rest of the budget
    ]
    assert "c" in engine.scheduler.waiting


def test_running_requests_are_served_before_admission() -> None:
    engine = make(max_num_batched_tokens=12)
    add(engine, "a", 20)
    engine.step()
    add(engine, "b", 4)
    batch = engine.scheduler.schedule()
    assert [(r.request_id, r.start, len(r.token_ids)) for r in batch.requests] == [
        ("a", 12, 8), ("b", 0, 4)]


def test_max_num_seqs_caps_running() -> None:
    engine = make(max_num_seqs=2)
    for rid in "abc":
        add(engine, rid, 2)
    batch = engine.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]


def test_head_of_line_is_not_overtaken() -> None:
    engine = make(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    add(engine, "a", 16, max_tokens=4)  # 4 blocks
    add(engine, "b", 12, max_tokens=4)  # needs 3 more, only 2 left
    add(engine, "c", 2, max_tokens=1)  # would fit, but waits behind b
    batch = engine.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["a"]
    assert list(engine.scheduler.waiting) == ["b", "c"]


def test_preemption_takes_the_newest_and_recomputes_exactly() -> None:
    engine = make(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    add(engine, "old", 3, max_tokens=4, seed=1)
    add(engine, "new", 3, max_tokens=4, seed=2)
    outputs: dict[str, list[int]] = {"old": [], "new": []}
    preempted_new = False
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        new = engine.requests.get("new")
        preempted_new |= new is not None and new.state is RequestState.PREEMPTED
        engine.pool.check_integrity()
    assert preempted_new and engine.scheduler.num_preemptions >= 1
    assert outputs["old"] == expected_output(1, 3, 4, 1000)
    assert outputs["new"] == expected_output(2, 3, 4, 1000)
    assert engine.pool.num_free == 4


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "param"),
    [(0, 1, "prompt"), (60, 8, "max_tokens"), (70, 1, "prompt")],
)
def test_requests_beyond_the_context_are_rejected(
    prompt_len: int, max_tokens: int, param: str
) -> None:
    engine = make(max_model_len=64)
    with pytest.raises(RequestRejected) as err:
        add(engine, "x", prompt_len, max_tokens)
    assert err.value.param == param
    assert not engine.requests and engine.pool.num_free == 64


def test_request_larger_than_the_pool_is_rejected_at_admission() -> None:
    engine = make(num_blocks=3, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="KV cache holds 3 blocks"):
        add(engine, "x", 10, max_tokens=4)  # 14 tokens: 4 blocks


def test_duplicate_request_id_is_rejected() -> None:
    engine = make()
    add(engine, "a", 2)
    with pytest.raises(RequestRejected) as err:
        add(engine, "a", 2)
    assert err.value.param == "request_id"
