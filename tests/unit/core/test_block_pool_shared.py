"""The shared pool: references on published blocks, the LRU of cached blocks,
eviction under pressure, and the one release path's checks (unit tests and a
hypothesis state machine against a model)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.core.block_pool import (
    BlockPool,
    BlockPoolError,
    DoubleFree,
    ForeignFree,
    OutOfBlocks,
    lease_owner,
    request_owner,
)

A, B, C = request_owner("a"), request_owner("b"), request_owner("c")


def cached_pool() -> tuple[BlockPool, list[int]]:
    """Two blocks of A published as h0, h1, then released to the cache."""
    pool = BlockPool(4)
    ids = pool.allocate(2, A)
    assert pool.publish(ids[0], b"h0", A) and pool.publish(ids[1], b"h1", A)
    pool.free(ids, A)
    return pool, ids


def test_released_published_blocks_are_cached_not_free() -> None:
    pool, ids = cached_pool()
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (2, 2, 0)
    assert pool.generations(ids) == [0, 0]  # content still valid: no bump
    assert pool.match([b"h0", b"h1", b"h2"]) == ids
    assert pool.match([b"h1"]) == [ids[1]] and pool.match([b"zz", b"h0"]) == []
    pool.check_integrity()


def test_a_hit_takes_a_cached_block_back_and_shares_an_in_use_one() -> None:
    pool, ids = cached_pool()
    pool.share(ids, B)
    assert pool.num_cached == 0 and pool.owners_of(ids[0]) == [B]
    pool.share(ids[:1], C)
    assert pool.owners_of(ids[0]) == [B, C] and pool.owned_count(C) == 1
    pool.free(ids[:1], B)  # B's reference only; C still holds it
    assert pool.owners_of(ids[0]) == [C] and pool.num_cached == 0
    pool.free(ids[:1], C)
    pool.free(ids[1:], B)
    assert pool.num_cached == 2 and pool.num_in_use == 0
    pool.check_integrity()


def test_double_release_of_a_shared_block_raises_naming_both_and_changes_nothing() -> None:
    pool, ids = cached_pool()
    pool.share(ids, B)
    pool.share(ids, C)
    pool.free(ids, B)
    before = pool.owners()
    with pytest.raises(ForeignFree) as err:
        pool.free(ids, B)  # B released them already; C still holds them
    assert "req:b" in str(err.value) and "req:c" in str(err.value)
    pool.free(ids, C)
    with pytest.raises(DoubleFree, match=r"req:c.*already cached"):
        pool.free(ids, C)
    assert before == {C: 2} and pool.owners() == {} and pool.num_cached == 2
    pool.check_integrity()


def test_eviction_under_pressure_is_lru_and_bumps_the_generation() -> None:
    pool, ids = cached_pool()
    # Released together, the chain's tail is evicted first: its head stays matchable.
    recorded = pool.generations(ids)  # a reader's fence
    got = pool.allocate(3, B)  # 2 free + 1 evicted
    assert ids[1] in got and ids[0] not in got
    assert pool.generation(ids[1]) == recorded[1] + 1 and pool.num_evictions == 1
    assert pool.match([b"h0", b"h1"]) == [ids[0]]  # h1 is gone
    assert pool.generations(ids) != recorded  # a fenced read of the evicted block fails
    with pytest.raises(OutOfBlocks):
        pool.allocate(2, C)
    pool.check_integrity()


def test_a_lease_holds_shared_blocks_against_eviction() -> None:
    pool, ids = cached_pool()
    pool.share(ids, B)
    pool.share(ids, C)
    lease = lease_owner("L")
    pool.transfer(ids, B, lease)  # B's references move to the lease
    assert pool.owners_of(ids[0]) == [lease, C] and pool.owned_count(B) == 0
    recorded = pool.generations(ids)
    pool.free(ids, C)
    assert not pool.can_allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(3, A)  # only the lease's blocks are left: never evicted
    assert pool.generations(ids) == recorded  # the fence would say done
    with pytest.raises(ForeignFree, match="lease:L"):
        pool.free(ids, B)
    pool.free(ids, lease)
    assert pool.num_cached == 2
    pool.check_integrity()


def test_can_allocate_counts_hits_taken_out_of_the_cache() -> None:
    pool, ids = cached_pool()
    assert pool.can_allocate(4) and not pool.can_allocate(3, reusing=ids)
    assert pool.can_allocate(2, reusing=ids)


def test_publish_and_share_refuse_what_they_must() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2, A)
    with pytest.raises(BlockPoolError, match="req:b tried to publish"):
        pool.publish(a[0], b"h", B)
    assert pool.publish(a[0], b"h", A)
    assert not pool.publish(a[1], b"h", A)  # same content elsewhere: stays private
    with pytest.raises(BlockPoolError, match="not published"):
        pool.share([a[1]], B)
    with pytest.raises(BlockPoolError, match="holds"):
        pool.share([a[0]], A)
    pool.free(a, A)
    assert pool.num_cached == 1 and pool.num_free == 3  # the private one was freed
    pool.share([a[0]], B)
    assert pool.owner_of(a[0]) == B
    pool.share([a[0]], C)
    with pytest.raises(BlockPoolError, match="shared by"):
        pool.owner_of(a[0])  # "the" owner of a shared block: a caller's bug
    pool.check_integrity()


OWNERS = [request_owner(x) for x in "abc"]
KEYS = [b"k0", b"k1", b"k2", b"k3", b"k4"]


class SharedPoolMachine(RuleBasedStateMachine):
    """A model of references: block -> owners; hash -> block; what is cached."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(6)
        self.refs: dict[int, set[str]] = {}
        self.published: dict[bytes, int] = {}
        self.gens = [0] * 6
        self.leases = 0

    def held(self, owner: str) -> list[int]:
        return sorted(b for b, o in self.refs.items() if owner in o)

    def cached(self) -> set[int]:
        return {b for b in self.published.values() if not self.refs.get(b)}

    def do_allocate(self, owner: str, n: int) -> list[int]:
        cached_before = self.cached()
        free = self.pool.num_blocks - len(self.refs) - len(cached_before)
        got = self.pool.allocate(n, owner)
        for b in got:
            assert b not in self.refs
            self.refs[b] = {owner}
            if b in cached_before:  # evicted: unpublished, generation bumped
                self.published = {k: v for k, v in self.published.items() if v != b}
                self.gens[b] += 1
        assert len(set(got) & cached_before) == max(0, n - free)  # free blocks go first
        return got

    def do_release(self, owner: str, blocks: list[int]) -> None:
        self.pool.free(blocks, owner)
        for b in blocks:
            self.refs[b].discard(owner)
            if not self.refs[b]:
                del self.refs[b]
                if b not in self.published.values():
                    self.gens[b] += 1

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(1, 3))
    def allocate(self, owner: str, n: int) -> None:
        if not self.pool.can_allocate(n):
            assert n > self.pool.num_blocks - len(self.refs)
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n, owner)
            return
        self.do_allocate(owner, n)

    @rule(owner=st.sampled_from(OWNERS), data=st.data(), key=st.sampled_from(KEYS))
    def publish(self, owner: str, data: st.DataObject, key: bytes) -> None:
        mine = self.held(owner)
        if not mine:
            return
        b = data.draw(st.sampled_from(mine))
        fresh = key not in self.published and b not in self.published.values()
        assert self.pool.publish(b, key, owner) is fresh
        if fresh:
            self.published[key] = b

    @rule(owner=st.sampled_from(OWNERS), key=st.sampled_from(KEYS))
    def share_by_hash(self, owner: str, key: bytes) -> None:
        hit = self.pool.match([key])
        assert hit == ([self.published[key]] if key in self.published else [])
        if not hit or owner in self.refs.get(hit[0], set()):
            return
        self.pool.share(hit, owner)
        self.refs.setdefault(hit[0], set()).add(owner)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def release(self, owner: str, data: st.DataObject) -> None:
        mine = self.held(owner)
        if mine:
            self.do_release(owner, data.draw(st.lists(st.sampled_from(mine), min_size=1,
                                                      unique=True)))

    @rule(owner=st.sampled_from(OWNERS), block=st.integers(0, 5))
    def bad_release_raises(self, owner: str, block: int) -> None:
        if owner in self.refs.get(block, set()):
            return
        before = (self.pool.owners(), self.pool.num_free, self.pool.num_cached)
        with pytest.raises((DoubleFree, ForeignFree)) as err:
            self.pool.free([block], owner)
        assert owner in str(err.value)
        assert all(o in str(err.value) for o in self.refs.get(block, set()))
        assert before == (self.pool.owners(), self.pool.num_free, self.pool.num_cached)

    @precondition(lambda self: self.leases < 3)
    @rule(owner=st.sampled_from(OWNERS))
    def lease_takes_and_releases(self, owner: str) -> None:
        """A lease takes all of owner's blocks; fresh allocations cannot evict them,
        so the generations it recorded still hold at its release (the fence)."""
        mine = self.held(owner)
        if not mine:
            return
        self.leases += 1
        lease = lease_owner(str(self.leases))
        self.pool.transfer(mine, owner, lease)
        for b in mine:
            self.refs[b].remove(owner)
            self.refs[b].add(lease)
        recorded = self.pool.generations(mine)
        spare = self.pool.num_free + self.pool.num_cached
        if spare:
            got = self.do_allocate(owner, spare)  # evicts every cached block
            assert not set(got) & set(mine)
            self.do_release(owner, got)
        assert self.pool.generations(mine) == recorded
        self.do_release(lease, mine)

    @invariant()
    def conserved_and_as_modelled(self) -> None:
        pool = self.pool
        pool.check_integrity()
        assert pool.num_free + pool.num_cached + pool.num_in_use == pool.num_blocks
        assert pool.num_cached == len(self.cached())
        assert pool.num_in_use == len(self.refs)
        for b in range(pool.num_blocks):
            assert set(pool.owners_of(b)) == self.refs.get(b, set())
        for key, b in self.published.items():
            assert pool.hash_of(b) == key
        assert [pool.generation(b) for b in range(6)] == self.gens


SharedPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                               deadline=None)
TestSharedPool = SharedPoolMachine.TestCase
