"""Hypothesis drives the engine with add, abort, schedule and complete in any order, and
a device that may finish a step's writes long after the step was applied."""

from collections import deque
from collections.abc import Mapping

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.lifecycle import HOLDS_BLOCKS, FinishReason
from kvrelay.core.runner import Batch, SampledToken
from kvrelay.core.scheduler import RequestRejected
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeDeviceWork, FakeRunner, expected_output

VOCAB = 20
EOS = 0


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        async_scheduling=st.booleans(),
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 16),
        max_seqs=st.integers(1, 4),
        caching=st.booleans(),
    )
    def setup(
        self, async_scheduling: bool, num_blocks: int, block_size: int, budget: int, max_seqs: int,
        caching: bool,
    ) -> None:
        cfg = SchedulerConfig(
            num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
            max_num_batched_tokens=budget, max_model_len=64, async_scheduling=async_scheduling,
            enable_prefix_caching=caching,
        )
        self.engine = Engine(cfg, runner=FakeRunner(VOCAB))
        self.runner = FakeRunner(VOCAB, block_size=block_size, pool=self.engine.pool, check_kv=True)
        self.depth = 2 if async_scheduling else 1
        self.in_flight: deque[tuple[Batch, Mapping[str, SampledToken]]] = deque()
        self.device: deque[tuple[Batch, FakeDeviceWork]] = deque()  # not done, in order
        self.tokens: dict[str, list[int]] = {}
        self.spec: dict[str, tuple[int, int, int]] = {}
        self.terminal: dict[str, FinishReason] = {}
        self.next_id = 0

    def collect(self) -> None:
        for out in self.engine.take_outputs():
            assert out.request_id not in self.terminal, f"output after terminal: {out}"
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                self.terminal[out.request_id] = out.finish_reason
                seed, prompt_len, max_tokens = self.spec[out.request_id]
                want = expected_output(seed, prompt_len, max_tokens, VOCAB, (EOS,))
                got = self.tokens[out.request_id]
                if out.finish_reason is FinishReason.ABORT:
                    assert got == want[: len(got)]
                else:
                    assert got == want

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 12), seed=st.integers(0, 99),
          family=st.integers(0, 2))
    def add(self, prompt_len: int, max_tokens: int, seed: int, family: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        # Prompts of one family share prefixes (the prefix cache's hits).
        prompt = [1 + family + i % (family + 1) for i in range(prompt_len)]
        try:
            self.engine.add_request(rid, prompt, SamplingParams(
                max_tokens=max_tokens, seed=seed), eos_token_ids=[EOS])
        except RequestRejected:
            return
        self.tokens[rid] = []
        self.spec[rid] = (seed, prompt_len, max_tokens)

    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = f"r{data.draw(st.integers(0, self.next_id - 1))}"
        self.engine.abort_request(rid)
        self.collect()

    @rule(device_lags=st.booleans())
    def schedule(self, device_lags: bool = False) -> None:
        if len(self.in_flight) >= self.depth:
            return
        batch = self.engine.schedule()
        if batch is not None:
            self.in_flight.append((batch, self.runner.execute(batch)))
            if device_lags or self.device:  # one stream: a step ends after the one before
                batch.completion = work = FakeDeviceWork()
                self.device.append((batch, work))

    @precondition(lambda self: bool(self.device))
    @rule()
    def device_done(self) -> None:
        self.device.popleft()[1].finish()

    @precondition(lambda self: bool(self.in_flight))
    @rule()
    def complete(self) -> None:
        self.engine.complete(*self.in_flight.popleft())
        self.collect()

    @invariant()
    def pool_is_sound(self) -> None:
        pool = self.engine.pool
        pool.check_integrity()
        for owner, count in pool.owners().items():
            req = self.engine.requests.get(owner.removeprefix("req:"))
            assert req is not None and req.state in HOLDS_BLOCKS, f"{owner} is past its fence"
            assert count == len(req.block_ids)
        for batch in [b for b, _ in self.in_flight] + [b for b, _ in self.device]:
            for sr in batch.requests:  # a step in flight, or whose device work is not done
                assert all(pool.holds(b, f"req:{sr.request_id}") for b in sr.block_ids)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        # Quiescence: drain everything, then every request ended once and all is free.
        for _ in range(10_000):
            if not self.engine.has_work() and not self.in_flight:
                break
            while self.device:
                self.device_done()
            if self.in_flight:
                self.complete()
            batch = self.engine.schedule()
            if batch is not None:
                self.in_flight.append((batch, self.runner.execute(batch)))
            self.collect()
        assert not self.engine.has_work()
        assert set(self.terminal) == set(self.tokens)
        pool = self.engine.pool
        assert pool.num_in_use == 0 and pool.num_free + pool.num_cached == pool.num_blocks


EngineMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestEngineMachine = EngineMachine.TestCase
