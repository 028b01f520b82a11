"""Lease table: exactly-once release, one attempt per lease, the fence reading the pool,
deadlines, stale answers, restarts."""

from __future__ import annotations

import itertools

import pytest

from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.core.kv_port import PoolLeaseBlocks
from kvrelay.relay.lease import LeaseState, LeaseTable, ReleaseReason, Status
from kvrelay.relay.protocol import ErrorCode

ENGINE = "p1"


def make_table(**kw: float) -> tuple[BlockPool, LeaseTable]:
    pool = BlockPool(16)
    counter = itertools.count()
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id=ENGINE,
                       acquire_timeout=kw.get("acquire", 30.0), hard_cap=kw.get("cap", 480.0),
                       new_lease_id=lambda: f"L{next(counter)}")
    return pool, table


def new_lease(pool: BlockPool, table: LeaseTable, rid: str = "r", now: float = 0.0, n: int = 3):
    blocks = pool.allocate(n, request_owner(rid))
    return table.create(rid, blocks, now, num_tokens=n * 4, first_token=7)


def test_create_moves_ownership_in_one_transfer() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    assert pool.owned_count(request_owner("r")) == 0
    assert pool.owned_count(f"lease:{lease.lease_id}") == 3
    assert lease.state is LeaseState.HELD
    table.check_integrity()


def test_full_pull_releases_once_and_later_messages_are_stale() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    lid = lease.lease_id
    assert table.acquire(ENGINE, lid, "d", "a1", 1.0).ok
    assert table.heartbeat(ENGINE, lid, "d", "a1", 2.0).ok
    ans = table.release(ENGINE, lid, "d", "a1", True, 3.0)
    assert ans.ok and ans.reason is ReleaseReason.DONE
    assert pool.num_free == 16
    # The committing attempt's retransmitted RELEASE(ok) gets the same verdict.
    again = table.release(ENGINE, lid, "d", "a1", True, 4.0)
    assert again.ok and again.reason is ReleaseReason.DONE
    for late in (
        table.abort(ENGINE, lid, 4.0, "d", "a1"),
        table.acquire(ENGINE, lid, "d", "a1", 4.0),
        table.heartbeat(ENGINE, lid, "d", "a1", 4.0),
    ):
        assert late.status is Status.RELEASED and late.reason is ReleaseReason.DONE
    assert table.stats.stale_messages == 4 and table.stats.fence_failures == 0
    assert table.stats.released == {"done": 1}
    assert table.expire(10_000.0) == []
    assert pool.num_free == 16


def test_a_replayed_lease_never_commits_for_another_attempt() -> None:
    """The same params twice on one decode engine: the second attempt is refused while
    the first pulls, and after the first committed it is told the lease is consumed,
    never 'ok'."""
    pool, table = make_table()
    lid = new_lease(pool, table).lease_id
    assert table.acquire(ENGINE, lid, "d", "a1", 0.0).ok
    busy = table.acquire(ENGINE, lid, "d", "a2", 0.1)
    assert busy.status is Status.ERROR and busy.code is ErrorCode.LEASE_BUSY
    for foreign in (table.release(ENGINE, lid, "d", "a2", True, 0.2),
                    table.heartbeat(ENGINE, lid, "d", "a2", 0.2),
                    table.abort(ENGINE, lid, 0.2, "d", "a2"),
                    table.read_grant(ENGINE, lid, "d", "a2", [0])):
        assert foreign.status is Status.ERROR and foreign.code is ErrorCode.NOT_HOLDER
    assert table.leases[lid].state is LeaseState.PULLING
    assert table.release(ENGINE, lid, "d", "a1", True, 0.3).ok
    for late in (table.acquire(ENGINE, lid, "d", "a2", 0.4),
                 table.release(ENGINE, lid, "d", "a2", True, 0.4)):
        assert late.status is Status.RELEASED and late.reason is ReleaseReason.DONE
        assert not late.ok
    assert table.stats.fence_failures == 0


def test_acquire_deadline_expires_and_late_done_is_refused() -> None:
    pool, table = make_table(acquire=5.0)
    lease = new_lease(pool, table)
    assert table.next_deadline() == 5.0
    assert table.acquire(ENGINE, lease.lease_id, "d", "a1", 0.0).ok
    assert table.expire(4.9) == []
    assert [x.lease_id for x in table.expire(5.0)] == [lease.lease_id]
    assert pool.num_free == 16
    late = table.release(ENGINE, lease.lease_id, "d", "a1", True, 6.0)
    assert late.status is Status.RELEASED and late.reason is ReleaseReason.EXPIRED
    assert table.stats.fence_failures == 1
    # A retransmission of the same commit, or another attempt's, is no new fence failure.
    table.release(ENGINE, lease.lease_id, "d", "a1", True, 6.5)
    table.release(ENGINE, lease.lease_id, "d", "a9", True, 6.5)
    assert table.stats.fence_failures == 1


def test_forged_release_of_an_unknown_lease_is_no_fence_failure() -> None:
    _, table = make_table()
    ans = table.release(ENGINE, "forged", "d", "a1", True, 0.0)
    assert ans.status is Status.ERROR and ans.code is ErrorCode.UNKNOWN_LEASE
    assert table.stats.fence_failures == 0 and table.stats.stale_messages == 1


def test_the_fence_reads_the_pool_generations_at_commit() -> None:
    """If a lease's block were freed and reused underneath it (a bug elsewhere), the
    commit must see the pool's changed generation and refuse."""
    pool, table = make_table()
    lease = new_lease(pool, table)
    lid = lease.lease_id
    assert table.acquire(ENGINE, lid, "d", "a1", 0.0).ok
    victim = lease.block_ids[1]
    pool.free([victim], f"lease:{lid}")  # the bug: freed behind the lease's back
    pool.allocate(1, "req:other")
    pool.transfer([victim], "req:other", f"lease:{lid}")  # owner looks right again
    ans = table.release(ENGINE, lid, "d", "a1", True, 1.0)
    assert ans.status is Status.ERROR and ans.code is ErrorCode.FENCE
    assert ans.reason is ReleaseReason.FAILED and table.stats.fence_failures == 1
    assert not table.leases
    pool.check_integrity()
    assert pool.num_free == 16


def test_reads_serve_each_block_once_to_the_holding_attempt() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table, n=4)
    lid, blocks = lease.lease_id, lease.block_ids
    denied = table.read_grant(ENGINE, lid, "d", "a1", blocks[:1])
    assert denied.code is ErrorCode.NOT_HOLDER  # HELD: nobody acquired it yet
    assert table.acquire(ENGINE, lid, "d", "a1", 0.0).ok
    assert table.read_grant(ENGINE, lid, "d", "a1", blocks[:2]).ok
    for bad in (blocks[:1], blocks[2:3] * 2, [blocks[3], 15]):
        ans = table.read_grant(ENGINE, lid, "d", "a1", bad)
        assert ans.code is ErrorCode.READ_DENIED
    assert table.read_grant(ENGINE, lid, "d", "a1", blocks[2:]).ok


def test_heartbeats_renew_but_never_past_the_hard_cap() -> None:
    pool, table = make_table(acquire=5.0, cap=12.0)
    lease = new_lease(pool, table)
    table.acquire(ENGINE, lease.lease_id, "d", "a1", 4.0)
    assert lease.deadline == 9.0
    table.heartbeat(ENGINE, lease.lease_id, "d", "a1", 8.0)
    assert lease.deadline == 12.0
    assert table.expire(11.9) == []
    assert len(table.expire(12.0)) == 1
    assert table.stats.released == {"expired": 1}


def test_second_engine_is_refused_and_duplicate_acquire_is_idempotent() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    assert table.acquire(ENGINE, lease.lease_id, "d1", "a1", 0.0).ok
    assert table.acquire(ENGINE, lease.lease_id, "d1", "a1", 0.1).ok
    assert table.acquire(ENGINE, lease.lease_id, "d2", "a1", 0.1).code is ErrorCode.LEASE_BUSY
    assert table.release(ENGINE, lease.lease_id, "d2", "a1", True, 0.2).status is Status.ERROR
    assert lease.state is LeaseState.PULLING


def test_the_proxy_may_abort_in_any_live_state() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    assert table.acquire(ENGINE, lease.lease_id, "d", "a1", 0.0).ok
    assert table.abort(ENGINE, lease.lease_id, 0.1).ok  # no holder: the proxy
    late = table.release(ENGINE, lease.lease_id, "d", "a1", True, 0.2)
    assert late.status is Status.RELEASED and late.reason is ReleaseReason.ABORTED
    assert pool.num_free == 16


def test_restarted_engine_rejects_leases_of_its_previous_life() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    ans = table.acquire("p0", lease.lease_id, "d", "a1", 0.0)
    assert ans.status is Status.ERROR and ans.code is ErrorCode.WRONG_ENGINE
    assert lease.state is LeaseState.HELD


def test_unknown_lease_is_an_error_and_counted() -> None:
    _, table = make_table()
    assert table.abort(ENGINE, "nope", 0.0).code is ErrorCode.UNKNOWN_LEASE
    assert table.stats.stale_messages == 1


def test_lease_ids_are_128_bit_random() -> None:
    pool = BlockPool(4)
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id=ENGINE)
    a = table.create("a", pool.allocate(1, request_owner("a")), 0.0, num_tokens=1, first_token=0)
    b = table.create("b", pool.allocate(1, request_owner("b")), 0.0, num_tokens=1, first_token=0)
    assert len(a.lease_id) == 32 and a.lease_id != b.lease_id
    assert int(a.lease_id, 16) != int(b.lease_id, 16)


def test_expiry_cost_does_not_scan_all_leases() -> None:
    pool = BlockPool(4000)
    counter = itertools.count()
    table = LeaseTable(PoolLeaseBlocks(pool), engine_id=ENGINE, acquire_timeout=10.0,
                       new_lease_id=lambda: f"L{next(counter)}")
    for i in range(2000):
        rid = f"r{i}"
        table.create(rid, pool.allocate(1, request_owner(rid)), float(i), num_tokens=1,
                     first_token=0)
    popped_before = len(table._deadlines)
    assert len(table.expire(10.0)) == 1
    assert len(table._deadlines) == popped_before - 1  # one heap pop, no sweep


def test_bad_timeouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="acquire_timeout"):
        LeaseTable(PoolLeaseBlocks(BlockPool(1)), engine_id=ENGINE, acquire_timeout=10.0,
                   hard_cap=5.0)


def test_shutdown_releases_every_live_lease_once() -> None:
    pool, table = make_table()
    a = new_lease(pool, table, "a")
    new_lease(pool, table, "b")
    table.acquire(ENGINE, a.lease_id, "d", "a1", 0.0)
    table.release_all(1.0)
    assert pool.num_free == 16 and not table.leases
    assert table.stats.released == {"aborted": 2}
    late = table.release(ENGINE, a.lease_id, "d", "a1", True, 2.0)
    assert late.reason is ReleaseReason.ABORTED and not late.ok


def test_tombstones_expire_after_their_ttl() -> None:
    pool, table = make_table(acquire=1.0, cap=2.0)
    lease = new_lease(pool, table)
    table.expire(1.0)
    assert table.abort(ENGINE, lease.lease_id, 2.5).status is Status.RELEASED
    table.expire(3.0)  # tombstone_ttl defaults to the hard cap
    assert table.abort(ENGINE, lease.lease_id, 3.0).code is ErrorCode.UNKNOWN_LEASE


def test_a_named_lease_not_made_yet_answers_not_yet_then_acquires() -> None:
    """vLLM's scheduler names a lease a step before its worker makes it: messages about
    it meanwhile are answered NOT_YET (not unknown), and count as no stale message."""
    pool, table = make_table()
    table.pending = lambda lid: lid == "V.1"
    ans = table.acquire(ENGINE, "V.1", "d", "a1", 0.0)
    assert ans.code is ErrorCode.NOT_YET and table.stats.stale_messages == 0
    assert table.acquire(ENGINE, "V.9", "d", "a1", 0.0).code is ErrorCode.UNKNOWN_LEASE
    blocks = pool.allocate(2, request_owner("r"))
    table.pending = lambda lid: False
    lease = table.create("r", blocks, 0.1, num_tokens=8, first_token=7, lease_id="V.1")
    assert lease.lease_id == "V.1"
    assert table.acquire(ENGINE, "V.1", "d", "a1", 0.2).ok
    table.check_integrity()


def test_an_abort_before_the_lease_is_made_frees_it_when_made() -> None:
    pool, table = make_table(acquire=5.0)
    table.pending = lambda lid: lid.startswith("V.")
    assert table.abort(ENGINE, "V.1", 0.0, "d", "a1").code is ErrorCode.NOT_YET
    table.abort(ENGINE, "V.2", 0.0, "d", "a1")
    assert list(table._aborted_early) == ["V.1", "V.2"]
    table.expire(6.0)  # never made within a lease timeout: forgotten
    assert not table._aborted_early
    table.abort(ENGINE, "V.1", 6.0, "d", "a1")
    blocks = pool.allocate(2, request_owner("r"))
    lease = table.create("r", blocks, 6.1, num_tokens=8, first_token=7, lease_id="V.1")
    assert lease.state is LeaseState.RELEASED and lease.reason is ReleaseReason.ABORTED
    assert pool.owned_count(f"lease:{lease.lease_id}") == 0 and not table.leases
    assert not table._aborted_early
    table.check_integrity()
