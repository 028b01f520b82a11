"""Step completion: no block goes back to the pool, or to a lease, while the device may
still write it.

On a GPU the model runner returns once a step's kernels are queued (with no sync at all
when no row samples: the middle chunks of a chunked prefill). The naive engine then
freed an aborted or preempted request's blocks on the host at once, and another request
(a pulled one, whose transfer writes on another stream) got them while the first
request's kernels still wrote. Here each step's completion token is a ``FakeDeviceWork``
that is done only when the test says so (``finish``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool, Owner, lease_owner
from kvrelay.core.engine import Engine, RequestOutput
from kvrelay.core.lifecycle import FinishReason, RequestState
from kvrelay.core.runner import Batch, SampledToken, ScheduledRequest, StepToken
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeDeviceWork, FakeRunner, expected_output


class LaggingRunner:
    """The fake runner, with every step's device work ended by the test."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.inner = FakeRunner(block_size=block_size, pool=pool, check_kv=True)
        self.work: dict[int, FakeDeviceWork] = {}

    def execute(self, batch: Batch) -> Mapping[str, SampledToken]:
        out = self.inner.execute(batch)
        batch.completion = self.work[batch.step_id] = FakeDeviceWork()
        return out

    def finish_all(self) -> None:
        for work in self.work.values():
            work.finish()


class CountingPool(BlockPool):
    """Counts every (block, owner) release, to show each block is freed exactly once."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.frees: Counter[tuple[int, Owner]] = Counter()

    def free(self, block_ids: Sequence[int], owner: Owner) -> None:
        super().free(block_ids, owner)
        self.frees.update((b, owner) for b in block_ids)


def make(num_blocks: int, budget: int) -> tuple[Engine, LaggingRunner, CountingPool]:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                          max_model_len=32)
    pool = CountingPool(num_blocks)
    runner = LaggingRunner(pool, 4)
    return Engine(cfg, runner, pool=pool), runner, pool


def params(max_tokens: int, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)


def step(engine: Engine) -> tuple[Batch | None, list[RequestOutput]]:
    """One step as the server's loop runs it, never blocking on a token."""
    batch = engine.schedule()
    sampled = engine.runner.execute(batch) if batch is not None else None
    outputs = engine.end_step(batch, sampled)
    engine.pool.check_integrity()
    return batch, outputs


def test_aborted_request_keeps_its_blocks_until_its_middle_chunk_is_done() -> None:
    engine, runner, pool = make(num_blocks=4, budget=8)
    x = engine.add_request("x", list(range(1, 13)), params(1))
    batch, _ = step(engine)
    assert batch is not None and [(r.request_id, r.sample) for r in batch.requests] == [
        ("x", False)]  # a middle chunk, alone: on a GPU nothing synchronised it
    x_blocks = list(x.block_ids)
    assert len(x_blocks) == 2
    assert engine.abort_request("x")
    [out] = engine.take_outputs()
    assert out.finished and out.finish_reason is FinishReason.ABORT  # the client knows now
    assert x.state is RequestState.FINISHING
    # Y needs every block of the pool: while X's step is not done it must not get X's.
    y = engine.add_request("y", list(range(40, 52)), params(4, seed=1))
    for _ in range(4):
        batch, _ = step(engine)
        for b in x_blocks:
            assert pool.owners_of(b) == ["req:x"], "a block freed while the device writes it"
        assert not set(y.block_ids) & set(x_blocks)
        if batch is not None:
            assert all(not set(r.block_ids) & set(x_blocks) for r in batch.requests)
    assert pool.num_free == 0 and y.state is RequestState.RUNNING
    toks: list[int] = []
    reused = False
    while engine.has_work():
        runner.finish_all()
        _, outs = step(engine)
        reused |= bool(set(y.block_ids) & set(x_blocks))
        toks += [t for o in outs if o.request_id == "y" for t in o.new_token_ids]
    assert reused  # Y did need X's blocks: it got them once the step was done
    assert toks == expected_output(1, 12, 4, 1000)
    assert all(pool.frees[(b, "req:x")] == 1 for b in x_blocks)  # freed exactly once
    assert pool.num_free == pool.num_blocks
    assert "x" not in engine.requests


def test_preemption_waits_for_the_victims_step_to_be_done() -> None:
    # O (older) decodes; X (newer) prefills in middle chunks whose device work is not
    # done. When O needs a block, X, the newest running request, is the victim, but
    # only once its steps are done: until then O waits.
    engine, runner, pool = make(num_blocks=4, budget=8)
    o = engine.add_request("o", [7, 7, 7], params(6, seed=3))
    x = engine.add_request("x", list(range(1, 14)), params(1, seed=4))
    for want in ([("o", True), ("x", False)], [("o", True), ("x", False)]):
        batch, _ = step(engine)
        assert batch is not None
        assert [(r.request_id, r.sample) for r in batch.requests] == want
    x_blocks = list(x.block_ids)
    assert pool.num_free == 0 and len(x_blocks) == 3 and len(o.block_ids) == 1
    for _ in range(3):  # O's next token needs a second block
        batch, _ = step(engine)
        assert batch is None
        assert x.state is RequestState.RUNNING and x.block_ids == x_blocks
        assert all(pool.owners_of(b) == ["req:x"] for b in x_blocks)
        assert engine.scheduler.num_preemptions == 0
    runner.finish_all()
    batch, _ = step(engine)
    assert engine.scheduler.num_preemptions == 1  # X, once its steps were done
    assert all(pool.frees[(b, "req:x")] == 1 for b in x_blocks)  # freed exactly once
    assert batch is not None and batch.requests[0].request_id == "o"
    assert set(o.block_ids) & set(x_blocks)  # the block O waited for was X's
    while engine.has_work():
        runner.finish_all()
        step(engine)
    assert o.output_token_ids == expected_output(3, 3, 6, 1000)
    assert x.output_token_ids == expected_output(4, 13, 1, 1000)  # recomputed
    assert pool.num_free == pool.num_blocks


def test_a_pulled_request_never_gets_blocks_the_device_still_writes() -> None:
    # The reviewer's scenario on the decode side: X's middle chunk runs alone, X is
    # aborted, a pulled request Y arrives. Its transfer writes on another stream, so Y
    # must not be handed X's blocks until X's step is done.
    engine, runner, pool = make(num_blocks=4, budget=8)
    x = engine.add_request("x", list(range(1, 13)), params(1))
    step(engine)
    x_blocks = list(x.block_ids)
    engine.abort_request("x")
    y = engine.add_request("y", list(range(40, 52)), params(2, seed=1),
                           remote_kv={"lease_id": "l"}, first_token=5)
    for _ in range(3):
        step(engine)
        assert engine.take_kv_waiting() == [] and y.state is RequestState.WAITING
        assert all(pool.owners_of(b) == ["req:x"] for b in x_blocks)
    runner.finish_all()
    step(engine)
    assert engine.take_kv_waiting() == [y] and y.state is RequestState.WAITING_FOR_KV
    assert set(x_blocks) <= set(y.block_ids)  # the transfer may write them now
    assert all(pool.frees[(b, "req:x")] == 1 for b in x_blocks)


def test_a_lease_is_offered_only_once_the_steps_that_wrote_its_blocks_are_done() -> None:
    from kvrelay.core.kv_port import PoolLeaseBlocks
    from kvrelay.relay.lease import LeaseTable
    from kvrelay.relay.prefill import PrefillRelay

    engine, runner, pool = make(num_blocks=4, budget=8)
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id="p-1")
    relay = PrefillRelay(table, address="127.0.0.1:1", compat="c", clock=lambda: 0.0)
    engine.kv_handoff = relay.kv_handoff
    x = engine.add_request("x", list(range(1, 13)), params(1), remote_decode=True)
    step(engine)  # the middle chunk
    _, outs = step(engine)  # the last chunk samples the first token: X is done on P
    [out] = outs
    assert out.finished and out.finish_reason is FinishReason.REMOTE_DECODE
    assert relay.kv_params == {} and table.leases == {}  # its steps may still write
    x_blocks = list(x.block_ids)
    assert len(x_blocks) == 3 and x.state is RequestState.FINISHING
    runner.work[0].finish()  # the middle chunk is done, the last one not yet
    step(engine)
    assert relay.kv_params == {} and table.leases == {}
    assert all(pool.owners_of(b) == ["req:x"] for b in x_blocks)
    runner.work[1].finish()
    step(engine)
    params_x = relay.kv_params["x"]  # what the proxy hands the decode engine
    assert params_x.block_ids == x_blocks and params_x.first_token == out.new_token_ids[0]
    assert all(pool.owners_of(b) == [lease_owner(params_x.lease_id)] for b in x_blocks)
    assert not engine.has_work() and pool.frees == Counter()  # handed over, not freed


def test_the_model_runner_sets_its_token_also_when_it_raises(tmp_path: Path) -> None:
    from kvrelay.model import load_model
    from kvrelay.testing.models import write_tiny_hf_model

    m = load_model(str(write_tiny_hf_model(tmp_path / "llama", seed=2)), block_size=4,
                   num_blocks=8)
    tokens: list[FakeDeviceWork] = []

    def step_token() -> StepToken:
        tokens.append(FakeDeviceWork())
        return tokens[-1]

    m.runner.step_token = step_token  # type: ignore[method-assign]
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=8,
                          max_model_len=32)
    engine = Engine(cfg, m.runner)
    x = engine.add_request("x", list(range(3, 15)), SamplingParams(max_tokens=2))
    batch, _ = step(engine)  # the real forward of a middle chunk
    assert batch is not None and batch.completion is tokens[0]
    x_blocks = list(x.block_ids)
    engine.abort_request("x")
    step(engine)
    assert all(engine.pool.owners_of(b) == ["req:x"] for b in x_blocks)
    tokens[0].finish()
    step(engine)
    assert "x" not in engine.requests and engine.pool.num_free == 8
    # A step that raises may have queued kernels already: it carries a token too.
    bad = Batch(7, [ScheduledRequest("z", [3] * 9, 0, [0, 1], True, SamplingParams(), 9)])
    with pytest.raises(ValueError, match="cannot hold"):
        m.runner.execute(bad)
    assert bad.completion is tokens[-1] and len(tokens) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_middle_chunk_carries_an_event_the_release_waits_for(tmp_path: Path) -> None:
    from kvrelay.model import load_model
    from kvrelay.model.runner import CudaStepDone
    from kvrelay.testing.models import write_tiny_hf_model

    m = load_model(str(write_tiny_hf_model(tmp_path / "llama", seed=2)), block_size=4,
                   num_blocks=8, device="cuda", enforce_eager=True)
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=8,
                          max_model_len=32)
    engine = Engine(cfg, m.runner)
    x = engine.add_request("x", list(range(3, 15)), SamplingParams(max_tokens=2))
    batch, _ = step(engine)  # no row samples: nothing synchronised the device
    assert batch is not None and isinstance(batch.completion, CudaStepDone)
    engine.abort_request("x")
    if not batch.completion.done():  # the kernels still run: the blocks stay with X
        assert x.state is RequestState.FINISHING and engine.pool.num_free < 8
    batch.completion.wait()
    assert batch.completion.done()
    step(engine)
    assert "x" not in engine.requests and engine.pool.num_free == 8
