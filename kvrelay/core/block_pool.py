"""The KV block pool: the only code in kvrelay that releases a block.

Every block has exactly one owner at any time: free (``None``), a request
(``"req:<id>"``), a lease (``"lease:<id>"``) or a quarantine (``"quarantine:<id>"``:
blocks a transfer that overran its drain deadline may still write into). Each block also carries a
generation number, incremented on every free, so a reader that recorded the
generation before copying can tell afterwards whether the block was freed (and
perhaps reused) underneath it: the fence of DESIGN section 3.

Conservation, checked by ``check_integrity``:
    num_free + sum(owned blocks of every owner) == num_blocks
and every block is either on the free stack or owned, never both.

All operations are O(1) per block: a free stack, per-block arrays, and a count
per owner. A release the caller is not entitled to raises, naming both owners:
a double free is a loud bug, never silently tolerated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
        self._owner: list[Owner | None] = [None] * num_blocks
        self._generation: list[int] = [0] * num_blocks
        # Popped from the end; reversed so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[Owner, int] = {}

    # -- queries ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def owner_of(self, block_id: int) -> Owner | None:
        return self._owner[block_id]

    def generation(self, block_id: int) -> int:
        return self._generation[block_id]

    def generations(self, block_ids: Sequence[int]) -> list[int]:
        gen = self._generation
        return [gen[b] for b in block_ids]

    def owned_count(self, owner: Owner) -> int:
        return self._owned.get(owner, 0)

    def owners(self) -> dict[Owner, int]:
        return dict(self._owned)

    # -- the three ways ownership changes --------------------------------------
    def allocate(self, n: int, owner: Owner) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"{owner} asked for {n} blocks, {len(self._free)} are free")
        if n == 0:
            return []
        free = self._free
        ids = free[-n:]
        del free[-n:]
        own = self._owner
        for b in ids:
            own[b] = owner
        self._owned[owner] = self._owned.get(owner, 0) + n
        return ids

    def free(self, block_ids: Sequence[int], owner: Owner) -> None:
        """Return ``block_ids`` to the pool. All of them must belong to ``owner``.

        Checked for every block before any is freed, so a rejected call changes
        nothing.
        """
        self._check_owned(block_ids, owner, "free")
        own, gen, free = self._owner, self._generation, self._free
        for b in block_ids:
            own[b] = None
            gen[b] += 1
            free.append(b)
        self._uncount(owner, len(block_ids))

    def transfer(self, block_ids: Sequence[int], from_owner: Owner, to_owner: Owner) -> None:
        """Move ownership in one step (a finished request's blocks to a lease)."""
        self._check_owned(block_ids, from_owner, "transfer")
        own = self._owner
        for b in block_ids:
            own[b] = to_owner
        self._uncount(from_owner, len(block_ids))
        if block_ids:
            self._owned[to_owner] = self._owned.get(to_owner, 0) + len(block_ids)

    # -- invariants ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Conservation and one owner per block. O(num_blocks): a check, not a hot path."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise IntegrityError("a block is on the free stack twice")
        counts: dict[Owner, int] = {}
        for b, owner in enumerate(self._owner):
            if owner is None:
                if b not in free_set:
                    raise IntegrityError(f"block {b} has no owner but is not free")
            else:
                if b in free_set:
                    raise IntegrityError(f"block {b} is owned by {owner} and on the free stack")
                counts[owner] = counts.get(owner, 0) + 1
        if counts != self._owned:
            raise IntegrityError(f"owner counts {self._owned} disagree with blocks {counts}")
        if len(self._free) + sum(counts.values()) != self.num_blocks:
            raise IntegrityError("free + owned != total")

    # -- helpers ---------------------------------------------------------------
    def _check_owned(self, block_ids: Iterable[int], owner: Owner, action: str) -> None:
        own = self._owner
        seen: set[int] = set()
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ForeignFree(f"{owner} tried to {action} block {b}: no such block")
            if b in seen:
                raise DoubleFree(f"{owner} tried to {action} block {b} twice in one call")
            seen.add(b)
            actual = own[b]
            if actual is None:
                raise DoubleFree(f"{owner} tried to {action} block {b}, which is already free")
            if actual != owner:
                raise ForeignFree(
                    f"{owner} tried to {action} block {b}, which is owned by {actual}"
                )

    def _uncount(self, owner: Owner, n: int) -> None:
        left = self._owned[owner] - n if n else self._owned.get(owner, 0)
        if left:
            self._owned[owner] = left
        else:
            self._owned.pop(owner, None)
