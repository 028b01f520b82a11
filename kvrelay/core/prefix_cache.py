"""Prefix caching: the hash chain that names a full block's content.

A full block's KV depends on every token before it, so block ``i`` is named by
``H_i = sha256(H_{i-1} || tokens of block i)``, with ``H_{-1} = sha256(salt)``. The
salt is the KV compatibility of the pool (model, dtype, layout...): equal hashes
from different salts never meet. sha256 makes an accidental collision, which would
hand a request another prefix's KV, practically impossible.

The pool keeps the hash <-> block map and the LRU (block_pool.py); the scheduler
matches prompts at admission and publishes blocks once full and computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# A block's identity in the cache: the hash of its tokens chained to its prefix's.
BlockHash = bytes


def root_hash(salt: str) -> BlockHash:
    return hashlib.sha256(b"kvrelay-prefix-cache\0" + salt.encode()).digest()


def extend_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int,
    root: BlockHash,
) -> None:
    """Append the hashes of blocks ``len(hashes) .. num_blocks - 1`` (which must be
    full in ``token_ids``) to ``hashes``: a request's chain grows with its tokens."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        chunk = array("q", token_ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(parent + chunk.tobytes()).digest()
        hashes.append(parent)


@dataclass
class PrefixCacheStats:
    """Like vLLM's: tokens looked up at admission, and tokens found computed."""

    queries: int = 0
    hits: int = 0
