"""Hypothesis state machine over the lease table: exactly-once release under any order."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.relay.lease import LeaseState, LeaseTable, Status

ENGINE = "p"
HOLDERS = st.sampled_from(["d1", "d2"])


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(24)
        ids = itertools.count()
        self.table = LeaseTable(self.pool, engine_id=ENGINE, acquire_timeout=5.0,
                                hard_cap=20.0, new_lease_id=lambda: f"L{next(ids)}")
        self.now = 0.0
        self.all_ids: list[str] = []
        self.frees: dict[str, int] = {}  # lease -> times its blocks were freed
        self.model: dict[str, tuple[LeaseState, str | None]] = {}  # expected state, holder
        self.nreq = 0
        self.released_at: dict[str, float] = {}

    def _pick(self, i: int) -> str:
        return self.all_ids[i % len(self.all_ids)]

    def _released(self, lease_id: str) -> None:
        self.frees[lease_id] = self.frees.get(lease_id, 0) + 1
        self.model[lease_id] = (LeaseState.RELEASED, None)
        self.released_at[lease_id] = self.now

    def _stale_status(self, lease_id: str) -> Status:
        # Tombstones answer late messages for tombstone_ttl, then the id is unknown.
        age = self.now - self.released_at[lease_id]
        return Status.RELEASED if age < self.table.tombstone_ttl else Status.ERROR

    @rule(n=st.integers(1, 4))
    def create(self, n: int) -> None:
        if not self.pool.can_allocate(n):
            return
        rid = f"r{self.nreq}"
        self.nreq += 1
        lease = self.table.create(rid, self.pool.allocate(n, request_owner(rid)), self.now,
                                  num_tokens=n, first_token=1)
        self.all_ids.append(lease.lease_id)
        self.model[lease.lease_id] = (LeaseState.HELD, None)

    @rule(dt=st.floats(0.0, 8.0))
    def advance(self, dt: float) -> None:
        self.now += dt
        for lease in self.table.expire(self.now):
            self._released(lease.lease_id)

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), holder=HOLDERS)
    def acquire(self, i: int, holder: str) -> None:
        lid = self._pick(i)
        state, cur = self.model[lid]
        ans = self.table.acquire(ENGINE, lid, holder, self.now)
        if state is LeaseState.HELD:
            assert ans.ok
            self.model[lid] = (LeaseState.PULLING, holder)
        else:
            assert ans.ok == (state is LeaseState.PULLING and cur == holder)

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), holder=HOLDERS)
    def heartbeat(self, i: int, holder: str) -> None:
        lid = self._pick(i)
        state, cur = self.model[lid]
        ans = self.table.heartbeat(ENGINE, lid, holder, self.now)
        assert ans.ok == (state is LeaseState.PULLING and cur == holder)

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), holder=HOLDERS, ok=st.booleans())
    def release(self, i: int, holder: str, ok: bool) -> None:
        lid = self._pick(i)
        state, cur = self.model[lid]
        ans = self.table.release(ENGINE, lid, holder, ok, self.now)
        may = state is LeaseState.HELD or (state is LeaseState.PULLING and cur == holder)
        assert ans.ok == may
        if may:
            self._released(lid)
        elif state is LeaseState.RELEASED:
            assert ans.status is self._stale_status(lid)

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), foreign=st.booleans())
    def abort(self, i: int, foreign: bool) -> None:
        lid = self._pick(i)
        state, _ = self.model[lid]
        ans = self.table.abort("old-life" if foreign else ENGINE, lid, self.now)
        if foreign:
            assert ans.status is Status.ERROR
        elif state is LeaseState.RELEASED:
            assert ans.status is self._stale_status(lid)
        else:
            assert ans.ok
            self._released(lid)

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()
        self.table.check_integrity()
        assert all(v == 1 for v in self.frees.values())
        live = {lid for lid, (s, _) in self.model.items() if s is not LeaseState.RELEASED}
        assert live == set(self.table.leases)
        for lid in live:
            assert self.table.leases[lid].state is self.model[lid][0]
        owned = sum(self.pool.owned_count(f"lease:{lid}") for lid in live)
        assert self.pool.num_free + owned == self.pool.num_blocks
        assert sum(self.table.stats.released.values()) == len(self.frees)

    def teardown(self) -> None:
        self.table.expire(self.now + 1000.0)
        assert self.pool.num_free == self.pool.num_blocks


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)
TestLeaseMachine = LeaseMachine.TestCase
