"""KV-aware routing: which engine most likely holds a request's prompt prefix in its cache.

The proxy sees text, not token ids, so it keeps per engine an approximate record of the
prompt prefixes it sent there (as vLLM production-stack's prefix-aware router does): a
prompt's text (for chat, the messages with their roles, in order) is cut into chunks of
``chunk_chars`` characters and each full chunk is named by a hash chain, the hash of
the chunk and of every chunk before it. Two prompts share chain hashes exactly as far
as they share whole chunks of text, so an engine's match is how many leading hashes of
the prompt's chain its record holds: O(chunks) dict lookups per engine, never a scan of
what was sent before.

Each record is a bounded LRU. A chain is touched tail first, so a chunk is always more
recently used than every chunk after it, and eviction takes tails before their
prefixes: a record stays prefix-closed (every recorded chunk's parent is recorded),
like an engine's block cache, which also evicts leaves first.

The choice (SGLang's cache-aware router in spirit: a match threshold and a balance
threshold): among the healthy engines, the one with the longest match when that match
covers at least ``cache_threshold`` of the prompt's text and the engine's outstanding
count is at most ``balance_abs_threshold`` above the least loaded one's; otherwise the
least loaded, ties going to the smallest record (a new prefix goes where the fewest
are, so prefixes spread over the engines). Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, TypeVar

__all__ = [
    "POLICIES",
    "Candidate",
    "PrefixRecord",
    "Reason",
    "RoutingConfig",
    "chain_hashes",
    "chat_text",
    "choose",
    "completion_text",
]

POLICIES = ("kv-aware", "least-outstanding")


class Reason(StrEnum):
    """Why an engine was picked: the ``reason`` label of ``kvrelay_proxy_route_total``."""

    PREFIX_MATCH = "prefix_match"  # the longest match, worth it and not overloaded
    LEAST_OUTSTANDING = "least_outstanding"  # no match worth it (or routing off)
    LOAD_BALANCE = "load_balance"  # a match worth it, on an engine too far above the least
    NO_HEALTHY = "no_healthy"  # every engine failed its health check: tried anyway


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "kv-aware"
    chunk_chars: int = 128
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 4
    cache_size: int = 16384
    # The records are fed by the engines' KV events (kvrelay.proxy.events), not
    # by the prompts sent; chains are then of token blocks, not of text chunks.
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        if self.chunk_chars < 1:
            raise ValueError(f"--routing-chunk-chars must be >= 1, got {self.chunk_chars}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--routing-cache-threshold must be between 0 and 1, "
                             f"got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("--routing-balance-abs-threshold must be >= 0, "
                             f"got {self.balance_abs_threshold}")
        if self.cache_size < 1:
            raise ValueError(f"--routing-cache-size must be >= 1, got {self.cache_size}")
        if self.kv_events and not self.kv_aware:
            raise ValueError("--kv-events routes by cached prefixes: it needs --routing "
                             f"kv-aware, not {self.policy}")

    @property
    def kv_aware(self) -> bool:
        return self.policy == "kv-aware"


def chain_hashes(text: str, chunk_chars: int) -> list[int]:
    """The hash chain of ``text``'s full chunks: entry i names chunks 0..i together."""
    out: list[int] = []
    prev = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        digest = hashlib.blake2b(text[start:start + chunk_chars].encode(), digest_size=8,
                                 key=prev).digest()
        out.append(int.from_bytes(digest, "little"))
        prev = digest
    return out


def chat_text(messages: Iterable[Mapping[str, Any]]) -> str:
    """Chat messages in order with their roles: what a chat template's prefix depends on
    (the template itself is the same on every engine of a cluster)."""
    return "".join(f"\x1e{m.get('role', '')}\x1f{m.get('content') or ''}" for m in messages)


def completion_text(prompt: str | list[int]) -> str:
    """A completion prompt: its text, or its token ids written out."""
    if isinstance(prompt, str):
        return prompt
    return "\x1d" + ",".join(map(str, prompt))


class PrefixRecord:
    """The chain hashes recently sent to one engine: a bounded LRU, prefix-closed."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def match(self, chain: Sequence[int]) -> int:
        """How many leading hashes of ``chain`` are recorded."""
        n = 0
        for h in chain:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, chain: Sequence[int]) -> None:
        """Record ``chain`` as most recently used, its first chunk last (see the module
        docstring: a parent is always more recent than its children), then evict the
        least recently used beyond the capacity."""
        lru = self._lru
        for h in reversed(chain):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class Candidate(Protocol):
    outstanding: int
    healthy: bool
    prefixes: PrefixRecord


C = TypeVar("C", bound=Candidate)


def choose(engines: Sequence[C], chain: Sequence[int], text_len: int,
           config: RoutingConfig) -> tuple[C, Reason]:
    """The engine for a prompt of ``text_len`` characters whose chain is ``chain``, and
    why. ``engines`` is not empty; none healthy: the least loaded, reason NO_HEALTHY."""
    healthy = [e for e in engines if e.healthy]
    if not healthy:
        return min(engines, key=lambda e: e.outstanding), Reason.NO_HEALTHY
    if not config.kv_aware:
        return min(healthy, key=lambda e: e.outstanding), Reason.LEAST_OUTSTANDING
    least = min(healthy, key=lambda e: (e.outstanding, len(e.prefixes)))
    if not chain:
        return least, Reason.LEAST_OUTSTANDING
    best, matched = max(((e, e.prefixes.match(chain)) for e in healthy),
                        key=lambda em: (em[1], -em[0].outstanding))
    if matched == 0 or matched * config.chunk_chars < config.cache_threshold * text_len:
        return least, Reason.LEAST_OUTSTANDING
    if best.outstanding > least.outstanding + config.balance_abs_threshold:
        return least, Reason.LOAD_BALANCE
    return best, Reason.PREFIX_MATCH
