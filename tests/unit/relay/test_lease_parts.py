"""A lease cut into parts (lease.py, "Parts"): the parts of a HELD lease made by the
first ACQUIRE or ABORT naming one, each a lease of its own over the same blocks; the
request reported once, after its last part; what is refused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.relay.lease import LeaseState, LeaseTable, ReleaseReason, Status, parse_part
from kvrelay.relay.protocol import ErrorCode
from kvrelay.vllm.prefill import VllmLeaseBlocks

ENGINE = "P"  # its worker holds 4 KV heads: leases split in 2 or 4


def make(splittable: bool = True, pending: set[str] | None = None
         ) -> tuple[VllmLeaseBlocks, LeaseTable]:
    blocks = VllmLeaseBlocks(16)
    table = LeaseTable(blocks, engine_id=ENGINE, acquire_timeout=5.0, hard_cap=20.0,
                       splittable=(lambda k: 4 % k == 0) if splittable else None,
                       pending=(lambda lid: lid.partition("/")[0] in pending)
                       if pending is not None else None)
    return blocks, table


def made(table: LeaseTable, lid: str = "L", now: float = 0.0) -> None:
    table.create("req", [3, 4, 5], now, num_tokens=10, first_token=7, lease_id=lid)


def test_part_ids() -> None:
    assert parse_part("E.1.ab/0/2") == ("E.1.ab", 0, 2)
    for bad in ("E.1.ab", "E/2/2", "E/0/1", "E/0/65", "E/x/2", "E/0/2/1", "E//2", "E/-1/2"):
        assert parse_part(bad) is None, bad


def test_acquiring_a_part_splits_the_lease_and_each_part_ends_once() -> None:
    blocks, table = make()
    made(table)
    g = blocks.generations([3, 4, 5])
    ans = table.acquire(ENGINE, "L/1/2", "D", "a1", 1.0)
    assert ans.ok and ans.lease is not None and ans.lease.part == (1, 2)
    assert table.release_reason("L") is ReleaseReason.SPLIT
    assert set(table.leases) == {"L/0/2", "L/1/2"}
    assert table.leases["L/0/2"].state is LeaseState.HELD
    table.check_integrity()
    assert table.release(ENGINE, "L/1/2", "D", "a1", True, 2.0).reason is ReleaseReason.DONE
    # the request waits for the other part; its blocks did not move
    assert [e[2] for e in blocks.take_released()] == [False, False]
    assert blocks.generations([3, 4, 5]) == g
    assert table.acquire(ENGINE, "L/0/2", "D2", "b1", 3.0).ok
    assert table.acquire(ENGINE, "L/0/2", "D", "a1", 3.0).code is ErrorCode.LEASE_BUSY
    assert table.release(ENGINE, "L/0/2", "D2", "b1", True, 4.0).reason is ReleaseReason.DONE
    assert blocks.take_released() == [("req", "L/0/2", True)]
    assert blocks.generations([3, 4, 5]) == [x + 1 for x in g]
    # late messages: the committed part's retransmission, the whole lease
    assert table.release(ENGINE, "L/1/2", "D", "a1", True, 5.0).reason is ReleaseReason.DONE
    late = table.acquire(ENGINE, "L", "D", "a9", 5.0)
    assert late.status is Status.RELEASED and late.reason is ReleaseReason.SPLIT
    assert table.acquire(ENGINE, "L/0/3", "D", "a9", 5.0).code is ErrorCode.UNKNOWN_LEASE
    assert table.stats.released == {"split": 1, "done": 2} and table.stats.created == 3


def test_a_lease_pulled_whole_has_no_parts_and_a_table_that_cannot_split_knows_none() -> None:
    _, table = make()
    made(table)
    assert table.acquire(ENGINE, "L", "D", "a1", 1.0).ok
    assert table.acquire(ENGINE, "L/0/2", "D", "a2", 1.0).code is ErrorCode.LEASE_BUSY
    assert set(table.leases) == {"L"}
    _, plain = make(splittable=False)
    made(plain)
    assert plain.acquire(ENGINE, "L/0/2", "D", "a1", 1.0).code is ErrorCode.UNKNOWN_LEASE
    assert set(plain.leases) == {"L"}


def test_parts_given_up_before_the_lease_is_made_are_released_when_it_is() -> None:
    blocks, table = make(pending={"L"})
    ans = table.abort(ENGINE, "L/0/2", 0.5, "D", "a1")
    assert ans.code is ErrorCode.NOT_YET
    made(table, now=1.0)
    assert table.release_reason("L") is ReleaseReason.SPLIT
    assert table.release_reason("L/0/2") is ReleaseReason.ABORTED
    assert set(table.leases) == {"L/1/2"}
    assert table.abort(ENGINE, "L/1/2", 2.0, "D", "a2").ok  # the other worker's give-back
    assert [e[2] for e in blocks.take_released()] == [False, False, True]


def test_unacquired_parts_expire_and_the_request_is_reported_once() -> None:
    blocks, table = make()
    made(table)
    assert table.abort(ENGINE, "L/3/4", 1.0, "D", "a1").ok  # splits, then this part
    assert table.acquire(ENGINE, "L/0/4", "D", "a2", 2.0).ok
    expired = table.expire(10.0)
    assert sorted(x.lease_id for x in expired) == ["L/0/4", "L/1/4", "L/2/4"]
    assert [e[2] for e in blocks.take_released()] == [False] * 4 + [True]
    assert not table.leases


def test_parts_the_heads_do_not_split_into_are_refused_before_any_split() -> None:
    _, table = make()
    made(table)
    ans = table.acquire(ENGINE, "L/0/3", "D", "a1", 1.0)  # 4 heads do not cut in 3
    assert ans.code is ErrorCode.BAD_RANGE and "cannot be cut into 3 parts" in ans.error
    assert table.abort(ENGINE, "L/1/3", 1.0, "D", "a1").code is ErrorCode.BAD_RANGE
    assert set(table.leases) == {"L"} and table.leases["L"].state is LeaseState.HELD


def test_early_part_aborts_are_found_by_their_lease_and_forgotten_with_it() -> None:
    """Early ABORTs of parts are indexed by their lease (making a lease never scans
    them all), and an early ABORT forgotten (its bound, or a lease timeout) leaves no
    index entry behind."""
    _, table = make(pending={"L", "M"})
    for i in range(2):
        table.abort(ENGINE, f"M/{i}/2", 0.0, "D", "a")
    table.abort(ENGINE, "L/1/2", 0.0, "D", "a")
    assert table._early_parts == {"M": ["M/0/2", "M/1/2"], "L": ["L/1/2"]}
    made(table, "L", now=1.0)
    assert table._early_parts == {"M": ["M/0/2", "M/1/2"]}
    assert set(table.leases) == {"L/0/2"}
    table.expire(10.0)  # M never made within a lease timeout: its early aborts go
    assert table._early_parts == {} and not table._aborted_early


@settings(max_examples=300, deadline=None)
@given(k=st.sampled_from([2, 4]), ops=st.lists(st.tuples(
    st.sampled_from(["acquire", "ok", "failed", "abort", "tick", "heartbeat"]),
    st.integers(0, 3)), max_size=30))
def test_any_order_of_part_messages_reports_the_request_once_after_every_part(
        k: int, ops: list[tuple[str, int]]) -> None:
    """Whatever the parts' messages and the clock do: the blocks stay held while any
    part is live, the request is reported once (when the last part ends, and only
    then), a part commits done only while it was live, and the table stays whole."""
    blocks, table = make()
    made(table)
    now, reported, done = 0.0, 0, set()
    for op, n in ops:
        pid = f"L/{n % k}/{k}"
        who = ("D", f"a{n % k}")
        if op == "acquire":
            table.acquire(ENGINE, pid, *who, now)
        elif op in ("ok", "failed"):
            live = pid in table.leases  # HELD too: a RELEASE(ok) with nothing read
            ans = table.release(ENGINE, pid, *who, op == "ok", now)
            if op == "ok" and ans.ok and ans.reason is ReleaseReason.DONE:
                assert live or pid in done  # a commit only of a live part (or its echo)
                done.add(pid)
        elif op == "abort":
            table.abort(ENGINE, pid, now, *who)
        elif op == "heartbeat":
            table.heartbeat(ENGINE, pid, *who, now)
        else:
            now += 3.0
            table.expire(now)
        table.check_integrity()
        for _rid, _lid, last in blocks.take_released():
            reported += last
        live = [x for x in table.leases.values() if x.request_id == "req"]
        assert reported == (0 if live else 1)
        assert blocks.held("L", [3, 4, 5]) or all(blocks.held(x.lease_id, x.block_ids)
                                                  for x in live)
    now += 30.0
    table.expire(now)
    reported += sum(last for *_x, last in blocks.take_released())
    assert reported == 1 and not table.leases


def test_the_proxys_abort_of_a_split_lease_releases_its_parts() -> None:
    """As it releases a lease being pulled: the part's commit then fails."""
    blocks, table = make()
    made(table)
    assert table.acquire(ENGINE, "L/0/2", "D", "a1", 1.0).ok
    ans = table.abort(ENGINE, "L", 2.0)  # the proxy: the client left
    assert ans.status is Status.RELEASED and ans.reason is ReleaseReason.SPLIT
    assert [table.release_reason(f"L/{i}/2") for i in range(2)] == [ReleaseReason.ABORTED] * 2
    late = table.release(ENGINE, "L/0/2", "D", "a1", True, 3.0)
    assert late.status is Status.RELEASED and late.reason is ReleaseReason.ABORTED
    assert table.stats.fence_failures == 1  # a copy under a released part never commits
    assert [e[2] for e in blocks.take_released()] == [False, False, True]
