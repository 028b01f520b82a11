"""Configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    async_scheduling: bool = False
    # Share full computed blocks between requests with the same token prefix. Off in
    # the core's default (its unit tests predate it); on by default in ``kvrelay serve``
    # and the offline LLM. The salt is the pool's KV compatibility (see prefix_cache).
    enable_prefix_caching: bool = False
    prefix_cache_salt: str = ""
    # Decode side: the most blocks that requests waiting for remote KV may hold at once
    # (their params come from clients; a pull that never comes holds its blocks until
    # the peer timeout). None: half the pool. One such request is always admitted, so a
    # prompt larger than the budget still runs.
    max_awaiting_kv_blocks: int | None = None
    # Decode side: the most pulled requests queued behind those bounds (not yet holding
    # blocks); one more is refused at once (HTTP 429 with Retry-After, its lease left
    # untouched for another engine or a retry) instead of waiting without end. None: 4 x
    # max_num_seqs.
    max_queued_kv_requests: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_awaiting_kv_blocks", "max_queued_kv_requests"):
            cap = getattr(self, name)
            if cap is not None and (not isinstance(cap, int) or cap < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {cap!r}")

    @property
    def awaiting_kv_block_budget(self) -> int:
        cap = self.max_awaiting_kv_blocks
        return cap if cap is not None else max(1, self.num_blocks // 2)

    @property
    def kv_queue_bound(self) -> int:
        cap = self.max_queued_kv_requests
        return cap if cap is not None else 4 * self.max_num_seqs

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
