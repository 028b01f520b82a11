"""Lease table: exactly-once release, deadlines, stale answers, restarts."""

from __future__ import annotations

import itertools

import pytest

from kvrelay.core.block_pool import BlockPool, request_owner
from kvrelay.relay.lease import LeaseState, LeaseTable, ReleaseReason, Status

ENGINE = "p1"


def make_table(**kw: float) -> tuple[BlockPool, LeaseTable]:
    pool = BlockPool(16)
    counter = itertools.count()
    table = LeaseTable(pool, engine_id=ENGINE, acquire_timeout=kw.get("acquire", 30.0),
                       hard_cap=kw.get("cap", 480.0), new_lease_id=lambda: f"L{next(counter)}")
    return pool, table


def new_lease(pool: BlockPool, table: LeaseTable, rid: str = "r", now: float = 0.0, n: int = 3):
    blocks = pool.allocate(n, request_owner(rid))
    return table.create(rid, blocks, now, num_tokens=n * 4, first_token=7)


def test_create_moves_ownership_in_one_transfer() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    assert pool.owned_count(request_owner("r")) == 0
    assert pool.owned_count(lease.owner) == 3
    assert lease.state is LeaseState.HELD
    table.check_integrity()


def test_full_pull_releases_once_and_later_messages_are_stale() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    assert table.acquire(ENGINE, lease.lease_id, "d", 1.0).ok
    assert table.heartbeat(ENGINE, lease.lease_id, "d", 2.0).ok
    ans = table.release(ENGINE, lease.lease_id, "d", True, 3.0, lease.generations)
    assert ans.ok and ans.reason is ReleaseReason.DONE
    assert pool.num_free == 16
    for again in (
        table.release(ENGINE, lease.lease_id, "d", True, 4.0),
        table.abort(ENGINE, lease.lease_id, 4.0),
        table.acquire(ENGINE, lease.lease_id, "d", 4.0),
    ):
        assert again.status is Status.RELEASED and again.reason is ReleaseReason.DONE
    assert table.stats.stale_messages == 3
    assert table.stats.released == {"done": 1}
    assert table.expire(10_000.0) == []
    assert pool.num_free == 16


def test_acquire_deadline_expires_and_late_done_is_refused() -> None:
    pool, table = make_table(acquire=5.0)
    lease = new_lease(pool, table)
    assert table.next_deadline() == 5.0
    assert table.expire(4.9) == []
    assert [x.lease_id for x in table.expire(5.0)] == [lease.lease_id]
    assert pool.num_free == 16
    late = table.release(ENGINE, lease.lease_id, "d", True, 6.0)
    assert late.status is Status.RELEASED and late.reason is ReleaseReason.EXPIRED
    assert table.stats.fence_failures == 1


def test_heartbeats_renew_but_never_past_the_hard_cap() -> None:
    pool, table = make_table(acquire=5.0, cap=12.0)
    lease = new_lease(pool, table)
    table.acquire(ENGINE, lease.lease_id, "d", 4.0)
    assert lease.deadline == 9.0
    table.heartbeat(ENGINE, lease.lease_id, "d", 8.0)
    assert lease.deadline == 12.0
    assert table.expire(11.9) == []
    assert len(table.expire(12.0)) == 1
    assert table.stats.released == {"expired": 1}


def test_second_holder_is_refused_and_duplicate_acquire_is_idempotent() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    assert table.acquire(ENGINE, lease.lease_id, "d1", 0.0).ok
    assert table.acquire(ENGINE, lease.lease_id, "d1", 0.1).ok
    assert table.acquire(ENGINE, lease.lease_id, "d2", 0.1).status is Status.ERROR
    assert table.release(ENGINE, lease.lease_id, "d2", True, 0.2).status is Status.ERROR
    assert table.readable(ENGINE, lease.lease_id, "d2").status is Status.ERROR
    assert table.readable(ENGINE, lease.lease_id, "d1").ok
    assert lease.state is LeaseState.PULLING


def test_restarted_engine_rejects_leases_of_its_previous_life() -> None:
    pool, table = make_table()
    lease = new_lease(pool, table)
    ans = table.acquire("p0", lease.lease_id, "d", 0.0)
    assert ans.status is Status.ERROR and "restarted" in ans.error
    assert lease.state is LeaseState.HELD


def test_unknown_lease_is_an_error_and_counted() -> None:
    _, table = make_table()
    assert table.abort(ENGINE, "nope", 0.0).status is Status.ERROR
    assert table.stats.stale_messages == 1


def test_lease_ids_are_128_bit_random() -> None:
    pool = BlockPool(4)
    table = LeaseTable(pool, engine_id=ENGINE)
    a = table.create("a", pool.allocate(1, request_owner("a")), 0.0, num_tokens=1, first_token=0)
    b = table.create("b", pool.allocate(1, request_owner("b")), 0.0, num_tokens=1, first_token=0)
    assert len(a.lease_id) == 32 and a.lease_id != b.lease_id


def test_expiry_cost_does_not_scan_all_leases() -> None:
    pool = BlockPool(4000)
    counter = itertools.count()
    table = LeaseTable(pool, engine_id=ENGINE, acquire_timeout=10.0,
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
        LeaseTable(BlockPool(1), engine_id=ENGINE, acquire_timeout=10.0, hard_cap=5.0)


def test_shutdown_releases_every_live_lease_once() -> None:
    pool, table = make_table()
    a = new_lease(pool, table, "a")
    new_lease(pool, table, "b")
    table.acquire(ENGINE, a.lease_id, "d", 0.0)
    table.release_all(1.0)
    assert pool.num_free == 16 and not table.leases
    assert table.stats.released == {"aborted": 2}
    assert table.release(ENGINE, a.lease_id, "d", True, 2.0).reason is ReleaseReason.ABORTED


def test_tombstones_expire_after_their_ttl() -> None:
    pool, table = make_table(acquire=1.0, cap=2.0)
    lease = new_lease(pool, table)
    table.expire(1.0)
    assert table.abort(ENGINE, lease.lease_id, 2.5).status is Status.RELEASED
    table.expire(3.0)  # tombstone_ttl defaults to the hard cap
    assert table.abort(ENGINE, lease.lease_id, 3.0).status is Status.ERROR
