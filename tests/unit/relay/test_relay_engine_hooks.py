"""The decode-side engine hooks: WAITING_FOR_KV, LOADING, DRAINING and the fallbacks."""

from __future__ import annotations

import pytest

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import FinishReason, IllegalTransition, RequestState
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeRunner, expected_output

PROMPT = list(range(10))


def engine() -> Engine:
    return Engine(SchedulerConfig(num_blocks=16, block_size=4), FakeRunner(100, block_size=4))


def remote(e: Engine, rid: str = "r", seed: int = 3) -> None:
    first = expected_output(seed, len(PROMPT), 1, 100)[0]
    e.add_request(rid, PROMPT, SamplingParams(max_tokens=4, seed=seed), remote_kv="kv",
                  first_token=first)


def test_admission_allocates_the_prompt_and_waits_for_kv_outside_any_batch() -> None:
    e = engine()
    remote(e)
    assert e.step() == []
    (req,) = e.take_kv_waiting()
    assert req.state is RequestState.WAITING_FOR_KV and len(req.block_ids) == 3
    assert e.take_kv_waiting() == [] and e.schedule() is None


def test_load_done_decodes_from_the_first_token() -> None:
    e = engine()
    remote(e)
    e.step()
    e.take_kv_waiting()
    e.kv_load_start("r")
    e.kv_load_done("r")
    req = e.requests["r"]
    assert req.state is RequestState.RUNNING and req.num_computed_tokens == len(PROMPT)
    out: list[int] = []
    while e.has_work():
        for o in e.step():
            out.extend(o.new_token_ids)
    assert out == expected_output(3, len(PROMPT), 4, 100)[1:]
    assert e.pool.num_free == 16


@pytest.mark.parametrize("recompute", [True, False])
def test_load_failed_frees_once_then_recomputes_or_fails(recompute: bool) -> None:
    e = engine()
    remote(e)
    e.step()
    e.take_kv_waiting()
    e.kv_load_start("r")
    e.kv_load_failed("r", "the prefill engine restarted", recompute=recompute)
    assert e.pool.num_free == 16
    outs = []
    while e.has_work():
        outs.extend(e.step())
    outs.extend(e.take_outputs())
    if recompute:
        assert [t for o in outs for t in o.new_token_ids] == expected_output(3, 10, 4, 100)[1:]
    else:
        assert outs[-1].finish_reason is FinishReason.ERROR
        assert outs[-1].error == "the prefill engine restarted"
    assert e.pool.num_free == 16 and not e.requests


def test_abort_while_loading_drains_until_the_transfer_ended() -> None:
    e = engine()
    remote(e)
    e.step()
    e.take_kv_waiting()
    e.kv_load_start("r")
    assert e.abort_request("r")
    assert e.requests["r"].state is RequestState.DRAINING and e.pool.num_free == 13
    assert not e.abort_request("r")  # terminal is terminal
    with pytest.raises(IllegalTransition):
        e.kv_load_done("r")
    e.kv_transfer_ended("r")
    assert "r" not in e.requests and e.pool.num_free == 16


def test_abort_while_waiting_for_kv_frees_at_once() -> None:
    e = engine()
    remote(e)
    e.step()
    e.take_kv_waiting()
    e.abort_request("r")
    assert "r" not in e.requests and e.pool.num_free == 16


def test_remote_kv_needs_the_first_token() -> None:
    with pytest.raises(ValueError, match="together"):
        engine().add_request("r", PROMPT, SamplingParams(), remote_kv="kv")


def test_a_first_token_that_completes_the_request_needs_no_kv() -> None:
    e = engine()
    first = expected_output(3, len(PROMPT), 1, 100)[0]
    req = e.add_request("r", PROMPT, SamplingParams(max_tokens=1, seed=3), remote_kv="kv",
                        first_token=first)
    assert req.state is RequestState.FINISHED and "r" not in e.requests
    (out,) = e.take_outputs()
    assert out.finished and out.finish_reason is FinishReason.LENGTH and out.new_token_ids == []
    assert e.pool.num_free == 16
