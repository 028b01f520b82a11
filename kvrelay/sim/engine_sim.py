"""Deterministic simulation of one engine: random workloads on a simulated clock.

Each seed draws a configuration (tight pools, small budgets, async scheduling on or
off, prefix caching mostly on) and a workload (arrivals, prompts of a few families
that share prefixes, output lengths, aborts at random moments, including while a
request is inside an in-flight step). Tight pools keep the prefix cache evicting.
Steps take simulated time, so aborts land between a step's scheduling and its
completion. In some seeds the device lags the host, as a GPU does when no row of a step
samples: a step's completion token (``Batch.completion``) is done only at a later
simulated time, after its output was applied. After every event the invariants below
are checked; the first violation ends the seed.

Invariants:
- pool integrity (free + cached + in use == total, each block in one place);
- every owner in the pool is a live request in a state that holds blocks, owning
  exactly its block table (no block owned by a request past its fence);
- every block of every in-flight step, and of every step whose device work is not
  done, is still held by the request it was scheduled for (nobody computes on freed
  or evicted KV, no block is reused while the device still writes it), and the fake
  runner's KV check (every slot a request samples from holds the KV of its own token
  prefix, shared cached blocks included);
- exactly one terminal output per request, nothing after it;
- finished requests produced exactly the fake runner's tokens (aborted ones a prefix);
- at quiescence every request is terminal and every block is free or cached.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine, RequestOutput
from kvrelay.core.lifecycle import HOLDS_BLOCKS, FinishReason
from kvrelay.core.runner import Batch, SampledToken
from kvrelay.core.scheduler import RequestRejected
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.fake_runner import FakeDeviceWork, FakeRunner, expected_output

EOS = 0


class Violation(AssertionError):
    pass


@dataclass
class SeedResult:
    seed: int
    trace: list[str] = field(default_factory=list)
    violation: str | None = None
    requests: int = 0
    rejected: int = 0
    aborted: int = 0

    @property
    def trace_digest(self) -> str:
        return hashlib.sha256("\n".join(self.trace).encode()).hexdigest()[:16]


class EventQueue:
    """A simulated clock: events run in (time, insertion) order; time jumps."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, time: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, self._seq, fn))
        self._seq += 1

    def run_next(self) -> bool:
        if not self._heap:
            return False
        self.now, _, fn = heapq.heappop(self._heap)
        fn()
        return True


class EngineSim:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = self.rng = random.Random(seed)
        block_size = rng.choice([1, 2, 4, 8])
        max_model_len = rng.choice([32, 64, 128])
        self.config = SchedulerConfig(
            num_blocks=rng.randint(max_model_len // block_size, 3 * max_model_len // block_size),
            block_size=block_size,
            max_num_seqs=rng.choice([1, 2, 4, 8, 32]),
            max_num_batched_tokens=rng.choice([1, 3, 8, 16, 64]),
            max_model_len=max_model_len,
            async_scheduling=rng.random() < 0.5,
            enable_prefix_caching=rng.random() < 0.75,
        )
        self.vocab = rng.choice([8, 50, 1000])
        # How far the device may run behind the host's completion of a step (0: none).
        self.device_lag = rng.choice([0.0, 0.0, 0.05, 0.5])
        self.engine = Engine(self.config, runner=_Unused())
        self.runner = FakeRunner(
            self.vocab, block_size=block_size, pool=self.engine.pool, check_kv=True
        )
        self.events = EventQueue()
        self.result = SeedResult(seed)
        self.in_flight: deque[tuple[Batch, Mapping[str, SampledToken]]] = deque()
        self.pipeline_end = 0.0
        self.device_end = 0.0
        self.device_tails: deque[tuple[Batch, FakeDeviceWork]] = deque()  # not done, in order
        self.tokens: dict[str, list[int]] = {}
        self.terminal: dict[str, FinishReason] = {}
        self.specs: dict[str, tuple[int, int, int]] = {}  # id -> (seed, prompt_len, max_tokens)

    # -- workload ----------------------------------------------------------------
    def plan(self) -> None:
        rng, cfg = self.rng, self.config
        n = rng.randint(1, 24)
        t = 0.0
        for i in range(n):
            t += rng.expovariate(1.0)
            rid = f"r{i}"
            prompt_len = rng.randint(0 if rng.random() < 0.03 else 1, cfg.max_model_len)
            max_tokens = rng.randint(1, max(1, cfg.max_model_len - prompt_len + 2))
            # A family's prompts share a prefix of random length, then differ.
            family, shared = rng.randrange(3), rng.randint(0, prompt_len)
            prompt = [1 + (5 * family + i) % 11 for i in range(shared)]
            prompt += [20 + rng.randrange(40) for _ in range(prompt_len - shared)]
            self.events.at(t, partial(self.arrive, rid, prompt, max_tokens))
            if rng.random() < 0.3:
                self.events.at(t + rng.expovariate(0.3), partial(self.abort, rid))
            if rng.random() < 0.05:  # a duplicate abort much later: must be a no-op
                self.events.at(t + rng.uniform(5, 50), partial(self.abort, rid))

    def arrive(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        prompt_len = len(prompt)
        seed = self.rng.randint(0, 2**31)
        ignore_eos = self.rng.random() < 0.2
        params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos)
        self.result.requests += 1
        try:
            self.engine.add_request(rid, prompt, params, eos_token_ids=[EOS])
        except RequestRejected as e:
            self.result.rejected += 1
            self.log(f"reject {rid} {e.param}")
            return
        self.specs[rid] = (seed, prompt_len, max_tokens if params.ignore_eos else -max_tokens)
        self.tokens[rid] = []
        self.log(f"add {rid} p={prompt_len} m={max_tokens}")

    def abort(self, rid: str) -> None:
        ok = self.engine.abort_request(rid)
        self.result.aborted += ok
        self.log(f"abort {rid} {ok}")

    # -- the pipeline ------------------------------------------------------------
    def pump(self) -> None:
        depth = 2 if self.config.async_scheduling else 1
        while len(self.in_flight) < depth:
            batch = self.engine.schedule()
            if batch is None:
                return
            sampled = self.runner.execute(batch)
            self.in_flight.append((batch, sampled))
            start = max(self.events.now, self.pipeline_end)
            self.pipeline_end = start + 0.05 + 0.01 * batch.num_tokens * self.rng.random()
            self.events.at(self.pipeline_end, self.complete)
            if self.device_lag:
                self.lag(batch)
            self.log(f"schedule {batch.step_id} " + ",".join(
                f"{r.request_id}:{r.start}+{len(r.token_ids)}" for r in batch.requests))

    def lag(self, batch: Batch) -> None:
        """The step's device work ends after the host applied it; in order, like a stream."""
        tail = FakeDeviceWork()
        batch.completion = tail
        end = self.pipeline_end + self.rng.uniform(0, self.device_lag)
        self.device_end = max(self.device_end, end)
        self.device_tails.append((batch, tail))
        self.events.at(self.device_end, self.device_done)

    def device_done(self) -> None:
        batch, tail = self.device_tails.popleft()
        tail.finish()
        self.log(f"device {batch.step_id}")

    def complete(self) -> None:
        batch, sampled = self.in_flight.popleft()
        self.engine.complete(batch, sampled)
        self.log(f"complete {batch.step_id}")

    def collect(self) -> None:
        for out in self.engine.take_outputs():
            self.record(out)

    def record(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid in self.terminal:
            raise Violation(f"{rid}: output after its terminal output ({out})")
        self.tokens[rid].extend(out.new_token_ids)
        if out.finished:
            assert out.finish_reason is not None
            self.terminal[rid] = out.finish_reason
            self.log(f"finish {rid} {out.finish_reason.value} n={len(self.tokens[rid])}")
            self.check_tokens(rid, out.finish_reason)

    # -- invariants ----------------------------------------------------------------
    def check_tokens(self, rid: str, reason: FinishReason) -> None:
        seed, prompt_len, signed_max = self.specs[rid]
        stop = () if signed_max > 0 else (EOS,)
        want = expected_output(seed, prompt_len, abs(signed_max), self.vocab, stop)
        got = self.tokens[rid]
        if reason is FinishReason.ABORT:
            ok = got == want[: len(got)]
        else:
            ok = got == want and reason is (
                FinishReason.STOP if want and want[-1] in stop else FinishReason.LENGTH
            )
        if not ok:
            raise Violation(f"{rid}: {reason.value} with tokens {got}, expected {want}")

    def check(self) -> None:
        engine, pool = self.engine, self.engine.pool
        pool.check_integrity()
        for owner, count in pool.owners().items():
            rid = owner.removeprefix("req:")
            req = engine.requests.get(rid)
            if req is None or req.state not in HOLDS_BLOCKS:
                raise Violation(f"{owner} owns {count} blocks but is not live")
            if count != len(req.block_ids):
                raise Violation(f"{owner} owns {count} blocks; its table has {len(req.block_ids)}")
        for batch, _ in self.in_flight:
            self.check_held(batch, "the step is in flight")
        for batch, _ in self.device_tails:
            self.check_held(batch, "the device still writes it")

    def check_held(self, batch: Batch, why: str) -> None:
        pool = self.engine.pool
        for sr in batch.requests:
            for b in sr.block_ids:
                if not pool.holds(b, f"req:{sr.request_id}"):
                    raise Violation(
                        f"step {batch.step_id}: block {b} of {sr.request_id} is owned by "
                        f"{pool.owners_of(b) or 'nobody'} while {why}"
                    )

    def check_quiescent(self) -> None:
        if self.in_flight or self.device_tails or self.engine.has_work():
            raise Violation(f"stalled: {len(self.engine.requests)} requests never finished")
        missing = set(self.tokens) - set(self.terminal)
        if missing:
            raise Violation(f"requests without a terminal output: {sorted(missing)}")
        pool = self.engine.pool
        if pool.num_in_use or pool.num_free + pool.num_cached != pool.num_blocks:
            raise Violation(f"{pool.owners()} still hold blocks at quiescence")
        stats = self.engine.scheduler.prefix_stats
        self.log(f"prefix cache: {stats.hits}/{stats.queries} tokens hit, "
                 f"{pool.num_evictions} evictions")

    # -- driver ----------------------------------------------------------------------
    def log(self, line: str) -> None:
        self.result.trace.append(f"{self.events.now:.4f} {line}")

    def run(self) -> SeedResult:
        try:
            self.log(f"config {self.config} vocab={self.vocab}")
            self.plan()
            while self.events.run_next():
                self.collect()
                self.pump()
                self.collect()
                self.check()
            self.check_quiescent()
        except AssertionError as e:  # Violation, KvCorruption
            self.result.violation = f"{type(e).__name__}: {e}"
        except Exception as e:  # a crash of the core is a violation too
            self.result.violation = f"crash {type(e).__name__}: {e}"
        return self.result


class _Unused:
    def execute(self, batch: Batch) -> dict[str, SampledToken]:
        raise AssertionError("the simulator drives schedule/complete itself")


def run_seed(seed: int) -> SeedResult:
    return EngineSim(seed).run()
