import pytest

from kvrelay.core.block_pool import (
    BlockPool,
    DoubleFree,
    ForeignFree,
    OutOfBlocks,
    lease_owner,
    request_owner,
)

A, B = request_owner("a"), request_owner("b")


def test_allocate_and_free_conserve_blocks() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3, A)
    assert len(set(ids)) == 3 and pool.num_free == 5 and pool.owned_count(A) == 3
    assert all(pool.owner_of(b) == A for b in ids)
    pool.check_integrity()
    pool.free(ids, A)
    assert pool.num_free == 8 and pool.owned_count(A) == 0 and pool.owners() == {}
    pool.check_integrity()


def test_free_bumps_generation_once_per_free() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(2, A)
    before = pool.generations(ids)
    pool.free(ids, A)
    assert pool.generations(ids) == [g + 1 for g in before]
    again = pool.allocate(2, B)
    assert sorted(again) == sorted(ids)
    assert pool.generations(ids) == [g + 1 for g in before]


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2, A)
    pool.free(ids, A)
    with pytest.raises(DoubleFree, match="already free"):
        pool.free(ids, A)
    assert pool.num_free == 4
    pool.check_integrity()


def test_foreign_free_names_both_owners_and_frees_nothing() -> None:
    pool = BlockPool(4)
    mine = pool.allocate(1, A)
    theirs = pool.allocate(1, B)
    with pytest.raises(ForeignFree) as err:
        pool.free(mine + theirs, A)
    assert "req:a" in str(err.value) and "req:b" in str(err.value)
    assert pool.owner_of(mine[0]) == A and pool.num_free == 2
    pool.check_integrity()


def test_same_block_twice_in_one_call_is_a_double_free() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(1, A)
    with pytest.raises(DoubleFree):
        pool.free(ids + ids, A)
    assert pool.owned_count(A) == 1


def test_unknown_block_id_is_rejected() -> None:
    pool = BlockPool(2)
    with pytest.raises(ForeignFree, match="no such block"):
        pool.free([7], A)


def test_transfer_moves_ownership_in_one_step() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3, A)
    lease = lease_owner("L1")
    pool.transfer(ids, A, lease)
    assert pool.owned_count(A) == 0 and pool.owned_count(lease) == 3
    with pytest.raises(ForeignFree):
        pool.free(ids, A)  # the request no longer owns them
    pool.free(ids, lease)
    assert pool.num_free == 4
    pool.check_integrity()


def test_transfer_of_foreign_blocks_raises() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(1, B)
    with pytest.raises(ForeignFree):
        pool.transfer(ids, A, lease_owner("x"))
    assert pool.owner_of(ids[0]) == B


def test_out_of_blocks() -> None:
    pool = BlockPool(2)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(3, A)
    assert pool.num_free == 2


def test_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1, A)
    pool._owned[A] = 2  # simulate a bookkeeping bug
    with pytest.raises(Exception, match="disagree"):
        pool.check_integrity()
