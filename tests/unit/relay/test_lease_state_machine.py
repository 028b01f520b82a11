"""Hypothesis state machine over the lease table: exactly-once release under any order,
and a lease bound to the one attempt (decode engine, nonce) that acquired it."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.core.kv_port import PoolLeaseBlocks
from kvrelay.relay.lease import LeaseState, LeaseTable, Status

ENGINE = "p"
# (decode engine, attempt): two attempts on one engine, and another engine.
HOLDERS = st.sampled_from([("d1", "a1"), ("d1", "a2"), ("d2", "a1")])
Holder = tuple[str, str]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(24)
        ids = itertools.count()
        self.table = LeaseTable(PoolLeaseBlocks(self.pool), engine_id=ENGINE, acquire_timeout=5.0,
                                hard_cap=20.0, new_lease_id=lambda: f"L{next(ids)}")
        self.now = 0.0
        self.all_ids: list[str] = []
        self.frees: dict[str, int] = {}  # lease -> times its blocks were freed
        self.model: dict[str, tuple[LeaseState, Holder | None]] = {}  # state, holder
        self.committed: dict[str, Holder] = {}  # released done: the committing attempt
        self.nreq = 0
        self.released_at: dict[str, float] = {}

    def _pick(self, i: int) -> str:
        return self.all_ids[i % len(self.all_ids)]

    def _released(self, lease_id: str, committed_by: Holder | None = None) -> None:
        self.frees[lease_id] = self.frees.get(lease_id, 0) + 1
        if committed_by is not None:
            self.committed[lease_id] = committed_by
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
    @rule(i=st.integers(0, 100), holder=HOLDERS, first=st.integers(-1, 5))
    def acquire(self, i: int, holder: Holder, first: int) -> None:
        """``first``: a partial pull from that block (the blocks before it cached on D);
        out of the lease's range it is refused and changes nothing."""
        lid = self._pick(i)
        state, cur = self.model[lid]
        before = list(self.table.leases[lid].block_ids) if lid in self.table.leases else []
        ans = self.table.acquire(ENGINE, lid, *holder, self.now, first)
        if state is LeaseState.HELD and 0 <= first <= len(before):
            assert ans.ok
            self.model[lid] = (LeaseState.PULLING, holder)
            lease = self.table.leases[lid]
            assert lease.block_ids == before[first:] and lease.first_block == first
            assert not any(self.pool.holds(b, f"lease:{lid}") for b in before[:first])
        elif state is LeaseState.HELD:
            assert not ans.ok and self.table.leases[lid].block_ids == before
        else:
            assert ans.ok == (state is LeaseState.PULLING and cur == holder)

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), holder=HOLDERS)
    def heartbeat(self, i: int, holder: Holder) -> None:
        lid = self._pick(i)
        state, cur = self.model[lid]
        ans = self.table.heartbeat(ENGINE, lid, *holder, self.now)
        assert ans.ok == (state is LeaseState.PULLING and cur == holder)

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), holder=HOLDERS, ok=st.booleans())
    def release(self, i: int, holder: Holder, ok: bool) -> None:
        lid = self._pick(i)
        state, cur = self.model[lid]
        ans = self.table.release(ENGINE, lid, *holder, ok, self.now)
        may = state is LeaseState.HELD or (state is LeaseState.PULLING and cur == holder)
        if may:
            assert ans.ok
            self._released(lid, holder if ok else None)
        elif state is LeaseState.RELEASED:
            stale = self._stale_status(lid)
            # Only the committing attempt's own RELEASE(ok) is answered ok again.
            again = ok and self.committed.get(lid) == holder and stale is Status.RELEASED
            assert ans.ok == again
            if not again:
                assert ans.status is stale
        else:
            assert not ans.ok

    @precondition(lambda self: self.all_ids)
    @rule(i=st.integers(0, 100), foreign=st.booleans(),
          by=st.one_of(st.none(), HOLDERS))
    def abort(self, i: int, foreign: bool, by: Holder | None) -> None:
        """``by`` None: the proxy's release; else a decode attempt's ABORT."""
        lid = self._pick(i)
        state, cur = self.model[lid]
        who = (None, None) if by is None else by
        ans = self.table.abort("old-life" if foreign else ENGINE, lid, self.now, *who)
        if foreign:
            assert ans.status is Status.ERROR
        elif state is LeaseState.RELEASED:
            assert ans.status is self._stale_status(lid)
        elif state is LeaseState.PULLING and by is not None and cur != by:
            assert ans.status is Status.ERROR  # another attempt pulls it
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
