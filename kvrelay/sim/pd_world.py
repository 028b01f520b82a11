"""The simulated world of the prefill/decode simulation: clock, network, KV, transport.

Everything is driven by one seeded ``random.Random`` and one heap of timed events,
so a seed is a replayable trace.

- ``SimClock``: events at simulated times; ties keep insertion order.
- ``SimNetwork``: delivers a message after a random delay; may drop or duplicate
  it; independent delays reorder.
- ``SimKv`` / ``SimRunner``: a KV "cache" of integer tags, one per token slot. The
  runner writes the tag of (request seed, position) for every position it computes,
  and before sampling it checks every earlier position: a decode step on KV that
  arrived torn or not at all is a violation (the fence failed).
- ``SimTransport``: a one-sided read like shm: it copies one block per event from
  the prefill engine's *current* KV (freed and reused blocks included, so a copy
  can be torn) into the decode engine's blocks, and checks that every block it
  writes is still owned by the loading request (DRAINING works).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.block_pool import BlockPool
from kvrelay.core.runner import PLACEHOLDER, Batch, SampledToken
from kvrelay.relay.transports.base import PeerInfo, TransferState, TransferStatus
from kvrelay.testing.fake_runner import FakeRunner


class Violation(AssertionError):
    """An invariant of DESIGN section 3 broke in the simulation."""


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._tie = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(when, self.now), next(self._tie), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run_next(self) -> bool:
        if not self._events:
            return False
        when, _, fn = heapq.heappop(self._events)
        self.now = when
        fn()
        return True

    @property
    def pending(self) -> int:
        return len(self._events)


@dataclass
class NetFaults:
    drop: float = 0.0
    dup: float = 0.0
    base_delay: float = 0.002
    jitter: float = 0.02
    slow: float = 0.0  # probability of a long delay (reordering across timeouts)
    # (start, end) windows in which every relay message is lost in silence: a half-open
    # connection or a partition (no reset, no error: the peer just stops answering).
    blackholes: list[tuple[float, float]] = field(default_factory=list)


class SimNetwork:
    def __init__(self, clock: SimClock, rng: random.Random, faults: NetFaults) -> None:
        self.clock = clock
        self.rng = rng
        self.faults = faults
        self.sent = self.dropped = self.duplicated = 0

    def deliver(self, fn: Callable[[], None]) -> None:
        f, rng = self.faults, self.rng
        self.sent += 1
        now = self.clock.now
        if any(start <= now < end for start, end in f.blackholes):
            self.dropped += 1
            return
        if rng.random() < f.drop:
            self.dropped += 1
            return
        copies = 2 if rng.random() < f.dup else 1
        self.duplicated += copies - 1
        for _ in range(copies):
            delay = f.base_delay + rng.expovariate(1.0 / f.jitter)
            if rng.random() < f.slow:
                delay += rng.uniform(0.5, 4.0)
            self.clock.after(delay, fn)


class SimKv:
    """One engine's KV memory: a tag per token slot."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots = [0] * (num_blocks * block_size)

    def block(self, b: int) -> list[int]:
        bs = self.block_size
        return self.slots[b * bs : (b + 1) * bs]

    def set_block(self, b: int, tags: Sequence[int]) -> None:
        bs = self.block_size
        self.slots[b * bs : (b + 1) * bs] = tags


class InjectedFault(RuntimeError):
    """A model step that raised (the simulated model failed on this batch)."""


class SimRunner:
    """FakeRunner sampling and ownership checks, plus KV tags written and verified.
    With ``fault`` (a callable drawing from the seed's rng) a step may raise."""

    def __init__(self, kv: SimKv, pool: BlockPool, vocab_size: int,
                 fault: Callable[[], bool] = lambda: False) -> None:
        self.kv = kv
        self.inner = FakeRunner(vocab_size, block_size=kv.block_size, pool=pool)
        self.fault = fault

    def execute(self, batch: Batch) -> Mapping[str, SampledToken]:
        if self.fault():
            raise InjectedFault(f"injected failure of a step of {len(batch.requests)}")
        all_tags = self.inner.prefix_tags(batch)
        out = self.inner.execute(batch)
        bs, slots = self.kv.block_size, self.kv.slots
        for sr in batch.requests:
            tags = all_tags[sr.request_id]
            ids = sr.block_ids
            end = sr.start + len(sr.token_ids)
            for pos in range(sr.start, end):
                slots[ids[pos // bs] * bs + pos % bs] = tags[pos]
            if sr.sample:
                for pos in range(end):
                    if slots[ids[pos // bs] * bs + pos % bs] != tags[pos]:
                        raise Violation(
                            f"{sr.request_id} decodes on bad KV at position {pos} "
                            f"(block {ids[pos // bs]})"
                        )
        assert PLACEHOLDER < 0
        return out


def run_step(engine: Any) -> list[Any]:
    """One engine step as the server's loop runs it: a runner exception fails the
    step's requests and the engine goes on; a Violation (an invariant check) stops the
    simulation."""
    batch = engine.schedule()
    if batch is None:
        return list(engine.end_step(None))
    try:
        sampled = engine.runner.execute(batch)
    except Violation:
        raise
    except Exception as exc:
        return list(engine.end_step(batch, error=exc))
    return list(engine.end_step(batch, sampled))


@dataclass
class SimHandle:
    remote: list[int]
    local: list[int]
    owner: str  # the decode request that owns the local blocks
    life: int  # the prefill engine's life this read started in
    next_block: int = 0
    cancelled: bool = False
    fail_at: int = -1  # block index where the transfer breaks (-1: never)
    # A stalled transfer makes no progress, and ignores cancel, until this time.
    stall_until: float = 0.0
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))
    started: float = 0.0


class SimTransport:
    """One-sided block reads on the simulated clock."""

    name = "sim"

    def __init__(
        self,
        clock: SimClock,
        rng: random.Random,
        *,
        source: Callable[[int], SimKv | None],  # prefill life -> its KV (None: gone)
        prefill_life: Callable[[], int],
        dest: SimKv,
        dest_pool: BlockPool,
        on_change: Callable[[], None],
        per_block: float,
        fail_prob: float,
        stall_prob: float = 0.0,
        throw_prob: float = 0.0,
    ) -> None:
        self.clock, self.rng = clock, rng
        self.source, self.prefill_life = source, prefill_life
        self.dest, self.dest_pool = dest, dest_pool
        self.on_change = on_change
        self.per_block, self.fail_prob = per_block, fail_prob
        self.stall_prob, self.throw_prob = stall_prob, throw_prob
        self.alive = True

    def register(self, kv_cache: Any) -> dict[str, Any]:
        return {}

    def read(self, peer: PeerInfo, lease_id: str, holder: str, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], *, attempt: str = "") -> SimHandle:
        if self.rng.random() < self.throw_prob:
            raise OSError("injected: the transport could not start the read")
        owner = self.dest_pool.owner_of(local_blocks[0]) if local_blocks else ""
        h = SimHandle(list(remote_blocks), list(local_blocks), owner or "",
                      self.prefill_life(), started=self.clock.now)
        if self.rng.random() < self.fail_prob:
            h.fail_at = self.rng.randrange(len(local_blocks) + 1)
        if self.rng.random() < self.stall_prob:
            h.stall_until = self.clock.now + self.rng.uniform(0.5, 30.0)
        self._schedule(h)
        return h

    def poll(self, handle: SimHandle) -> TransferStatus:
        return handle.status

    def cancel(self, handle: SimHandle) -> None:
        handle.cancelled = True  # the block in flight still lands

    def _schedule(self, h: SimHandle) -> None:
        delay = self.per_block * self.rng.uniform(0.5, 1.5)
        if h.stall_until > self.clock.now and self.rng.random() < 0.5:
            delay = h.stall_until - self.clock.now  # stuck mid-copy, cancel or not
        self.clock.after(delay, lambda: self._step(h))

    def _step(self, h: SimHandle) -> None:
        """One block lands. A block copy in flight when cancel() came still lands:
        a real transport cannot take back bytes already on their way."""
        if not self.alive:
            return
        src = self.source(h.life)
        if h.next_block == h.fail_at or src is None:
            h.status = TransferStatus(TransferState.FAILED, error="the transfer broke")
        elif h.next_block == len(h.local):
            nbytes = len(h.local) * self.dest.block_size
            h.status = TransferStatus(TransferState.DONE, nbytes=nbytes,
                                      seconds=self.clock.now - h.started)
        else:
            i = h.next_block
            b = h.local[i]
            # A transfer that overran its drain bound writes into quarantined blocks,
            # where nothing else can see the bytes; any other owner is a violation.
            quarantined = "quarantine:" + h.owner.removeprefix("req:")
            if self.dest_pool.owner_of(b) not in (h.owner, quarantined):
                raise Violation(f"a transfer writes into block {b}, which is owned by "
                                f"{self.dest_pool.owner_of(b)}, not {h.owner}")
            self.dest.set_block(b, src.block(h.remote[i]))
            h.next_block += 1
            if not h.cancelled:
                self._schedule(h)
                return
            h.status = TransferStatus(TransferState.FAILED, error="cancelled")
        self.on_change()
