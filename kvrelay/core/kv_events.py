"""KV events: what an engine's prefix cache gained and lost, for routers outside it.

The core only records; the server drains the record every step and publishes it
(kvrelay.wire.kv_events: vLLM's KV-events format over ZMQ). Three kinds, as vLLM's:

    Stored    blocks published in the prefix cache (``BlockPool.publish`` that took):
              their hashes, the hash of the block before the first one (None at the
              start of a prompt), their token ids and the block size
    Removed   published blocks evicted (``BlockPool`` bumps their generation)
    Cleared   every published block gone: the first event of a new engine's record,
              and the first one after events were dropped

The record is bounded: when full the oldest event is dropped and counted, and the next
take starts with Cleared. A consumer that missed a Removed would believe forever in a
block the engine no longer has; after Cleared it forgets everything and relearns from
new events, so what it believes stays a subset of what the engine holds.

Pure: no clock, no I/O, no threads (the engine loop's thread records and takes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvrelay.core.prefix_cache import BlockHash


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


class KvEventLog:
    """The events since the last ``take``, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._events: deque[KvEvent] = deque()
        self.dropped = 0  # events dropped because the record was full, ever
        # A new record: consumers learn that this engine's cache starts empty (a
        # restarted engine's old blocks are gone).
        self._cleared = True

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None,
               token_ids: list[int], block_size: int) -> None:
        if block_hashes:
            self._append(Stored(tuple(block_hashes), parent, tuple(token_ids), block_size))

    def removed(self, block_hash: BlockHash) -> None:
        self._append(Removed((block_hash,)))

    def take(self) -> list[KvEvent]:
        """Every event recorded since the last take, oldest first (Cleared first after
        a drop); the record is empty afterwards."""
        out: list[KvEvent] = [Cleared()] if self._cleared else []
        self._cleared = False
        out.extend(self._events)
        self._events.clear()
        return out

    def _append(self, event: KvEvent) -> None:
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self.dropped += 1
            self._cleared = True  # the dropped one may have been a Removed
        self._events.append(event)
