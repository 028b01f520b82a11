"""A hand-driven prefill/decode pair: the test decides the order of every event.

The production objects (Engine, LeaseTable, PrefillRelay, Receiver) with a manual
link (messages wait in ``outbox`` until the test delivers them) and a manual
transport (blocks land when the test says so, copied from P's current KV memory).
KV is the simulator's tag memory: the runners refuse to sample on KV that is not
the request's own, so decoding a torn copy raises.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.engine import Engine
from kvrelay.core.kv_port import EngineKvLoads, PoolLeaseBlocks
from kvrelay.relay import protocol as P
from kvrelay.relay.lease import LeaseTable
from kvrelay.relay.prefill import PrefillRelay
from kvrelay.relay.receiver import Policy, Receiver, ReceiverConfig, RemoteKv
from kvrelay.relay.transports.base import PeerInfo, TransferState, TransferStatus
from kvrelay.sampling_params import SamplingParams
from kvrelay.sim.pd_world import SimKv, SimRunner
from kvrelay.testing.fake_runner import expected_output

COMPAT = "test"
VOCAB = 997
BS = 4
NBLOCKS = 16


@dataclass
class Handle:
    remote: list[int]
    local: list[int]
    owner: str
    landed: int = 0
    cancelled: bool = False
    status: TransferStatus = field(default_factory=lambda: TransferStatus(TransferState.PENDING))


class ManualTransport:
    name = "manual"

    def __init__(self, src: SimKv, dst: SimKv, dst_pool: BlockPool) -> None:
        self.src, self.dst, self.dst_pool = src, dst, dst_pool
        self.handles: list[Handle] = []

    def register(self, kv_cache: Any) -> dict[str, Any]:
        return {}

    def read(self, peer: PeerInfo, lease_id: str, holder: str, remote: Sequence[int],
             local: Sequence[int], *, attempt: str = "") -> Handle:
        h = Handle(list(remote), list(local), self.dst_pool.owner_of(local[0]) or "")
        self.handles.append(h)
        return h

    def poll(self, h: Handle) -> TransferStatus:
        return h.status

    def cancel(self, h: Handle) -> None:
        h.cancelled = True

    def land(self, h: Handle, n: int | None = None) -> None:
        """Copy the next ``n`` blocks (all that are left by default)."""
        end = len(h.local) if n is None else h.landed + n
        for i in range(h.landed, end):
            b = h.local[i]
            # Quarantined blocks (a drain that overran its bound) may take late writes.
            quarantined = "quarantine:" + h.owner.removeprefix("req:")
            assert self.dst_pool.owner_of(b) in (h.owner, quarantined), \
                f"write into block {b} we do not own"
            self.dst.set_block(b, self.src.block(h.remote[i]))
        h.landed = end

    def finish(self, h: Handle, ok: bool = True) -> None:
        state = TransferState.DONE if ok else TransferState.FAILED
        h.status = TransferStatus(state, "" if ok else "broken", nbytes=h.landed * BS)


class Pair:
    def __init__(self, *, p_async: bool = False, d_async: bool = False,
                 policy: Policy = Policy.RECOMPUTE, acquire: float = 5.0,
                 d_max_len: int = 64, caching: bool = False) -> None:
        self.now = 0.0
        ids = itertools.count()
        self.p_pool = BlockPool(NBLOCKS)
        self.p_kv = SimKv(NBLOCKS, BS)
        self.table = LeaseTable(PoolLeaseBlocks(self.p_pool), engine_id="p1",
                                acquire_timeout=acquire, hard_cap=acquire * 10,
                                new_lease_id=lambda: f"L{next(ids)}")
        self.relay = PrefillRelay(self.table, address="p", compat=COMPAT, clock=lambda: self.now)
        self.p = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=BS,
                                        async_scheduling=p_async,
                                        enable_prefix_caching=caching),
                        SimRunner(self.p_kv, self.p_pool, VOCAB), pool=self.p_pool,
                        kv_handoff=self.relay.kv_handoff)
        self.d_pool = BlockPool(NBLOCKS)
        self.d_kv = SimKv(NBLOCKS, BS)
        self.d = Engine(SchedulerConfig(num_blocks=NBLOCKS, block_size=BS, max_model_len=d_max_len,
                                        async_scheduling=d_async,
                                        enable_prefix_caching=caching),
                        SimRunner(self.d_kv, self.d_pool, VOCAB), pool=self.d_pool)
        self.transport = ManualTransport(self.p_kv, self.d_kv, self.d_pool)
        self.outbox: list[P.Request] = []
        self.replies: list[P.Reply] = []
        cfg = ReceiverConfig(policy=policy, rto=1.0, peer_timeout=10.0, copy_timeout=30.0,
                             heartbeat_interval=2.0)
        attempts = itertools.count(1)
        self.rx = Receiver(EngineKvLoads(self.d), self, self.transport, holder="d1",
                           compat=COMPAT, config=cfg, new_attempt=lambda: f"a{next(attempts)}")
        self.relay_trusted = True  # may D share KV pulled from P (RelayLink.trusted)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}

    # RelayLink
    def send(self, relay: str, msg: P.Request) -> None:
        self.outbox.append(msg)

    def peer(self, relay: str) -> PeerInfo:
        return PeerInfo("p", self.table.engine_id)

    def trusted(self, relay: str) -> bool:
        return self.relay_trusted

    # -- driving -------------------------------------------------------------------
    @staticmethod
    def params(seed: int, max_tokens: int = 4) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, seed=seed)

    def prefill(self, rid: str, prompt_len: int = 9, seed: int = 1,
                max_tokens: int = 4) -> RemoteKv:
        self.p.add_request(rid, self.prompt(prompt_len), self.params(seed, max_tokens),
                           remote_decode=True)
        while self.p.has_work():
            self.p.step()
        return RemoteKv.from_dict(self.relay.kv_params.pop(rid).to_dict())

    def start_copy(self, rid: str = "r", prompt_len: int = 9) -> tuple[RemoteKv, Handle]:
        """Prefill ``rid``, submit it to D, and let D acquire the lease: the transfer
        is in flight and nothing has landed yet."""
        kv = self.prefill(rid, prompt_len)
        self.submit(rid, kv, prompt_len)
        self.step_d()
        self.deliver_to_p()  # ACQUIRE
        self.deliver_to_d()
        return kv, self.transport.handles[-1]

    @staticmethod
    def prompt(n: int) -> list[int]:
        return [(3 * i + 1) % VOCAB for i in range(n)]

    @staticmethod
    def expect(seed: int, prompt_len: int = 9, max_tokens: int = 4) -> list[int]:
        return expected_output(seed, prompt_len, max_tokens, VOCAB)

    def submit(self, rid: str, kv: RemoteKv, prompt_len: int = 9, seed: int = 1,
               max_tokens: int = 4) -> None:
        self.rx.submit(rid, self.prompt(prompt_len), self.params(seed, max_tokens), kv,
                       self.now)

    def deliver_to_p(self, keep: int = 0) -> list[P.Reply]:
        """P handles every waiting message but the last ``keep``; replies queue for D."""
        msgs = self.outbox[: len(self.outbox) - keep]
        del self.outbox[: len(msgs)]
        out = [self.relay.handle(m, self.now) for m in msgs]
        self.replies.extend(out)
        return out

    def deliver_to_d(self) -> None:
        replies, self.replies = self.replies, []
        for r in replies:
            self.rx.on_reply(r, self.now)
        self.tick()

    def tick(self) -> None:
        self.rx.tick(self.now)
        self._collect(self.d.take_outputs())

    def step_d(self) -> None:
        """One turn of the decode loop: tick, step, tick (admissions start loads)."""
        self.tick()
        self._collect(self.d.step())
        self.tick()

    def _collect(self, outs: list[Any]) -> None:
        for o in outs:
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in self.finished, f"{o.request_id} finished twice"
                self.finished[o.request_id] = o

    def converse(self, rounds: int = 50) -> None:
        """Run D, the relay and P to the end with no interference."""
        for _ in range(rounds):
            self.step_d()
            if self.transport.handles:
                for h in self.transport.handles:
                    if h.status.state is TransferState.PENDING:
                        self.transport.land(h)
                        self.transport.finish(h, ok=not h.cancelled)
            self.deliver_to_p()
            self.deliver_to_d()
            if not (self.d.has_work() or self.rx.has_work() or self.outbox or self.replies):
                return
        raise AssertionError("the pair did not settle")

    def assert_all_free(self) -> None:
        self.p_pool.check_integrity()
        self.d_pool.check_integrity()
        # (with prefix caching, published blocks rest in the cache)
        assert self.p_pool.num_in_use == 0, self.p_pool.owners()
        assert self.d_pool.num_in_use == 0, self.d_pool.owners()
        assert not self.table.leases
        assert self.table.stats.created == sum(self.table.stats.released.values())
        assert not self.rx.loads and not self.d.requests
