"""The KV block pool: the only code in kvrelay that releases a block.

Each block is in exactly one of three places:

    free      on the free stack: no owner, no content anyone may look up
    cached    no owner, but published under the hash of its token prefix (prefix
              caching): a new request with the same prefix may take it back; kept
              in an LRU and evicted (made free, generation bumped) on demand
    in use    one or more owners: a request (``"req:<id>"``), a lease
              (``"lease:<id>"``) or a quarantine (``"quarantine:<id>"``: blocks a
              transfer that overran its drain deadline may still write into)

A block has several owners only when it is a published (full, computed, immutable)
block that another request matched by hash (``share``): each owner holds one
reference and releases it once, through ``free``. A lease that takes a request's
blocks takes its references (``transfer``), shared ones too: while the lease lives
the blocks cannot be evicted, so their generations cannot change under a copy.

Each block carries a generation number, bumped whenever its content stops being
what it was: on the free of an unpublished block and on eviction. A reader that
recorded the generations before copying can tell afterwards whether a block was
freed (and perhaps reused) underneath it: the fence of DESIGN section 3. Releasing
a published block to the cache does not bump it: its content stays valid.

Conservation, checked by ``check_integrity``:
    num_free + num_cached + num_in_use == num_blocks
and every block is in exactly one place.

All operations are O(1) per block: a free stack, per-block arrays, a dict of extra
owners of shared blocks, hash <-> block dicts and an ordered dict as the LRU. A
release the caller is not entitled to raises, naming the caller and the owners: a
double free is a loud bug, never silently tolerated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvrelay.core.prefix_cache import BlockHash

if TYPE_CHECKING:
    from kvrelay.core.kv_events import KvEventLog

Owner = str


def request_owner(request_id: str) -> Owner:
    return f"req:{request_id}"


def lease_owner(lease_id: str) -> Owner:
    return f"lease:{lease_id}"


def quarantine_owner(request_id: str) -> Owner:
    """Blocks a transfer may still write into after its request ended (see kv_port)."""
    return f"quarantine:{request_id}"


class BlockPoolError(RuntimeError):
    """Base class of the pool's accounting errors: each one is a bug in the caller."""


class DoubleFree(BlockPoolError):
    pass


class ForeignFree(BlockPoolError):
    pass


class OutOfBlocks(BlockPoolError):
    pass


class IntegrityError(BlockPoolError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # The first owner of an in-use block (None: free or cached); the others of a
        # shared block in ``_more`` (never empty there, never the first owner again).
        self._owner: list[Owner | None] = [None] * num_blocks
        # (dicts, not sets: insertion order keeps replays deterministic)
        self._more: dict[int, dict[Owner, None]] = {}
        self._generation: list[int] = [0] * num_blocks
        # Popped from the end; reversed so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[Owner, int] = {}
        # Published blocks: hash <-> block. A cached block is published and unowned;
        # ``_lru`` holds exactly those, least recently released first.
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        # Set when the server publishes KV events: evictions are recorded here (the
        # scheduler records what it publishes, with the tokens the pool never sees).
        self.events: KvEventLog | None = None

    # -- queries ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Published blocks nobody holds: reusable by a prefix hit, evictable."""
        return len(self._lru)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    def can_allocate(self, n: int, reusing: Sequence[int] = ()) -> bool:
        """Can ``n`` new blocks be had (evicting cached ones) after ``share(reusing)``?"""
        lru = self._lru
        taken = sum(1 for b in reusing if b in lru)
        return n <= len(self._free) + len(lru) - taken

    def holds(self, block_id: int, owner: Owner) -> bool:
        if self._owner[block_id] == owner:
            return True
        more = self._more.get(block_id)
        return more is not None and owner in more

    def owners_of(self, block_id: int) -> list[Owner]:
        first = self._owner[block_id]
        if first is None:
            return []
        return [first, *sorted(self._more.get(block_id, ()))]

    def owner_of(self, block_id: int) -> Owner | None:
        """The one owner of a block (None: free or cached). A shared block has several:
        asking for "the" owner of one is a bug in the caller (use ``holds``)."""
        if block_id in self._more:
            raise BlockPoolError(f"block {block_id} is shared by {self.owners_of(block_id)}")
        return self._owner[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._lru

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def generation(self, block_id: int) -> int:
        return self._generation[block_id]

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        gen = self._generation
        return [gen[b] for b in block_ids]

    def owned_count(self, owner: Owner) -> int:
        return self._owned.get(owner, 0)

    def owners(self) -> dict[Owner, int]:
        return dict(self._owned)

    def match(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The published blocks of the longest prefix of ``hashes`` (changes nothing)."""
        out: list[int] = []
        by_hash = self._by_hash
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    # -- the ways ownership changes ------------------------------------------------
    def allocate(self, n: int, owner: Owner) -> list[int]:
        """``n`` blocks for ``owner``: free ones first, then the least recently used
        cached ones, evicted (unpublished, generation bumped)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        free = self._free
        if n > len(free) + len(self._lru):
            raise OutOfBlocks(f"{owner} asked for {n} blocks, {len(free)} are free and "
                              f"{len(self._lru)} cached")
        if n == 0:
            return []
        short = n - len(free)
        while short > 0:
            self._evict_one()
            short -= 1
        ids = free[-n:]
        del free[-n:]
        own = self._owner
        for b in ids:
            own[b] = owner
        self._owned[owner] = self._owned.get(owner, 0) + n
        return ids

    def share(self, block_ids: Sequence[int], owner: Owner) -> None:
        """Take a reference to published blocks (a prefix hit): cached ones leave the
        LRU, in-use ones gain an owner. Checked in full before anything changes."""
        seen: set[int] = set()
        for b in block_ids:
            if b not in self._hash_of:
                raise BlockPoolError(f"{owner} tried to share block {b}, which is not "
                                     "published")
            if b in seen or self.holds(b, owner):
                raise BlockPoolError(f"{owner} tried to share block {b}, which it holds")
            seen.add(b)
        own, lru = self._owner, self._lru
        for b in block_ids:
            if own[b] is None:
                del lru[b]
                own[b] = owner
            else:
                self._more.setdefault(b, {})[owner] = None
        if block_ids:
            self._owned[owner] = self._owned.get(owner, 0) + len(block_ids)

    def publish(self, block_id: int, block_hash: BlockHash, owner: Owner) -> bool:
        """Make a full, computed block of ``owner`` findable by its prefix hash. False
        (nothing changes) when another block already holds that content: this one
        stays private and is freed as usual."""
        if not self.holds(block_id, owner):
            raise BlockPoolError(f"{owner} tried to publish block {block_id}, held by "
                                 f"{self.owners_of(block_id) or 'nobody'}")
        if block_hash in self._by_hash or block_id in self._hash_of:
            return False
        self._by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def free(self, block_ids: Sequence[int], owner: Owner) -> None:
        """Release ``owner``'s reference to each of ``block_ids``: the one release path.

        Checked for every block before any is released, so a rejected call changes
        nothing. A block nobody holds any more becomes free (generation bumped) or,
        if published, cached; a request's blocks enter the LRU tail first, so its
        prefix's head is evicted last (a hit needs the whole chain from the start).
        """
        self._check_owned(block_ids, owner, "free")
        own, gen, free, more = self._owner, self._generation, self._free, self._more
        cached: list[int] = []
        for b in block_ids:
            others = more.get(b)
            if others is not None:  # shared: drop this reference only
                if own[b] == owner:
                    heir = next(iter(others))
                    own[b] = heir
                    del others[heir]
                else:
                    del others[owner]
                if not others:
                    del more[b]
                continue
            own[b] = None
            if b in self._hash_of:
                cached.append(b)
            else:
                gen[b] += 1
                free.append(b)
        for b in reversed(cached):
            self._lru[b] = None
        self._uncount(owner, len(block_ids))

    def transfer(self, block_ids: Sequence[int], from_owner: Owner, to_owner: Owner) -> None:
        """Move references in one step (a finished request's blocks to a lease)."""
        self._check_owned(block_ids, from_owner, "transfer")
        for b in block_ids:
            if self.holds(b, to_owner):
                raise BlockPoolError(f"{from_owner} tried to transfer block {b} to "
                                     f"{to_owner}, which holds it already")
        own, more = self._owner, self._more
        for b in block_ids:
            if own[b] == from_owner:
                own[b] = to_owner
            else:
                others = more[b]
                del others[from_owner]
                others[to_owner] = None
        self._uncount(from_owner, len(block_ids))
        if block_ids:
            self._owned[to_owner] = self._owned.get(to_owner, 0) + len(block_ids)

    # -- invariants ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Conservation, each block in one place, consistent owner counts and hashes.
        O(num_blocks): a check, not a hot path."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise IntegrityError("a block is on the free stack twice")
        for h, b in self._by_hash.items():
            if self._hash_of.get(b) != h:
                raise IntegrityError(f"block {b} is published under a hash it does not have")
        if len(self._hash_of) != len(self._by_hash):
            raise IntegrityError("hash_of and by_hash disagree")
        counts: dict[Owner, int] = {}
        in_use = 0
        for b, first in enumerate(self._owner):
            places = (b in free_set) + (b in self._lru) + (first is not None)
            if places != 1:
                raise IntegrityError(f"block {b} is in {places} places (free, cached, in use)")
            if b in self._lru and b not in self._hash_of:
                raise IntegrityError(f"cached block {b} is not published")
            if b in free_set and b in self._hash_of:
                raise IntegrityError(f"free block {b} is still published")
            if first is None:
                if b in self._more:
                    raise IntegrityError(f"block {b} has extra owners but no first owner")
                continue
            in_use += 1
            others = self._more.get(b, {})
            if b in self._more and (not others or first in others):
                raise IntegrityError(f"block {b}: bad owner set {first} + {list(others)}")
            if others and b not in self._hash_of:
                raise IntegrityError(f"block {b} is shared but not published")
            for o in (first, *others):
                counts[o] = counts.get(o, 0) + 1
        if counts != self._owned:
            raise IntegrityError(f"owner counts {self._owned} disagree with blocks {counts}")
        if len(self._free) + len(self._lru) + in_use != self.num_blocks:
            raise IntegrityError("free + cached + in use != total")

    # -- helpers ---------------------------------------------------------------
    def _evict_one(self) -> None:
        b, _ = self._lru.popitem(last=False)
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        if self.events is not None:
            self.events.removed(h)
        self._generation[b] += 1  # a fenced read of the old content now fails
        self._free.append(b)
        self.num_evictions += 1

    def _check_owned(self, block_ids: Iterable[int], owner: Owner, action: str) -> None:
        seen: set[int] = set()
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ForeignFree(f"{owner} tried to {action} block {b}: no such block")
            if b in seen:
                raise DoubleFree(f"{owner} tried to {action} block {b} twice in one call")
            seen.add(b)
            if self.holds(b, owner):
                continue
            holders = self.owners_of(b)
            if not holders:
                where = "cached" if b in self._lru else "free"
                raise DoubleFree(f"{owner} tried to {action} block {b}, which is already "
                                 f"{where}")
            raise ForeignFree(f"{owner} tried to {action} block {b}, which is owned by "
                              f"{', '.join(holders)}")

    def _uncount(self, owner: Owner, n: int) -> None:
        left = self._owned[owner] - n if n else self._owned.get(owner, 0)
        if left:
            self._owned[owner] = left
        else:
            self._owned.pop(owner, None)
