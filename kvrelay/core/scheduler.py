"""Continuous batching: admission, chunked prefill, recompute preemption.

The scheduler decides which requests compute which tokens in the next step and
keeps each request's block table large enough for them. It owns the waiting and
running queues (insertion-ordered dicts: FCFS iteration, O(1) removal by id).

``free_blocks`` is the one path from a request's blocks back to the pool; the
engine calls it for release, the scheduler for preemption.

Prefix caching (``enable_prefix_caching``): at admission a request's known tokens
are matched, block by block, against published blocks (``pool.match`` on the hash
chain); the hits are shared (one reference each) and computation starts after them.
At least one token is always computed, so there are logits to sample from. A block
is published once it is full and a completed step has written it (``publish_computed``,
called by the engine as steps complete): published blocks are never written again,
so sharing them is safe; each holder releases its reference through ``free_blocks``.

Preemption never touches a request that a step which has not landed still
references (async scheduling, or device work not done: ``Request.in_flight``): such
a step may still read or write its blocks. When no
victim is free to take, the request that needs blocks waits a step instead.
"""

from __future__ import annotations

from collections import OrderedDict

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.lifecycle import Event, RequestState
from kvrelay.core.prefix_cache import PrefixCacheStats, extend_hashes, root_hash
from kvrelay.core.request import Request
from kvrelay.core.runner import PLACEHOLDER, Batch, ScheduledRequest


class RequestRejected(ValueError):
    """A request the engine can never serve; ``param`` names the offending input."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class KvQueueFull(Exception):
    """Decode side: a pulled request arrived with ``max_queued_kv_requests`` already
    queued. Not a ``RequestRejected``: nothing is wrong with the request (its lease is
    left untouched, so another engine, or this one later, can pull it); the client is
    told to retry (HTTP 429 with ``Retry-After``)."""

    retry_after_s = 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: dict[str, Request] = {}
        # Decode side: admitted with blocks, waiting for (or loading) remote KV. They
        # count against max_num_seqs like running requests, and the blocks they hold
        # against the awaiting-KV block budget (their params are a client's).
        self.awaiting_kv: dict[str, Request] = {}
        # Blocks each took at admission, and their sum. A transfer that overran its drain
        # bound moves some to quarantine (Engine.kv_quarantine) while the request still
        # waits: they stay pinned, so they stay counted until the request leaves.
        self._awaiting_blocks: dict[str, int] = {}
        self.awaiting_kv_blocks = 0
        self.newly_awaiting_kv: list[Request] = []
        # Pulled requests in ``waiting`` (no blocks yet): bounded by kv_queue_bound.
        self.queued_kv = 0
        self.num_preemptions = 0
        self._next_step_id = 0
        self.caching = config.enable_prefix_caching
        self._root = root_hash(config.prefix_cache_salt)
        self.prefix_stats = PrefixCacheStats()

    # -- admission -------------------------------------------------------------
    def check_admissible(self, prompt_len: int, max_tokens: int, *, pulled: bool = False
                         ) -> None:
        """RequestRejected for a request this engine can never serve; KvQueueFull for a
        ``pulled`` one (its KV comes from a prefill engine) beyond the queue bound."""
        cfg = self.config
        if pulled and self.queued_kv >= cfg.kv_queue_bound:
            raise KvQueueFull(
                f"{self.queued_kv} requests whose KV is pulled are already queued on this "
                f"decode engine (max_queued_kv_requests {cfg.kv_queue_bound}); retry later "
                "or send it to another decode engine")
        if prompt_len < 1:
            raise RequestRejected("prompt", "the prompt is empty; at least one token is required")
        if prompt_len + max_tokens > cfg.max_model_len:
            raise RequestRejected(
                "max_tokens" if prompt_len < cfg.max_model_len else "prompt",
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens; this model's maximum context length "
                f"is {cfg.max_model_len} tokens",
            )
        need = cfg.blocks_for(prompt_len + max_tokens)
        if need > self.pool.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"the prompt plus max_tokens needs {need} KV blocks of {cfg.block_size} "
                f"tokens; the KV cache holds {self.pool.num_blocks} blocks in all",
            )

    def add(self, req: Request) -> None:
        self.waiting[req.request_id] = req
        if req.remote_kv is not None:
            self.queued_kv += 1

    def remove(self, req: Request) -> None:
        if self.waiting.pop(req.request_id, None) is not None and req.remote_kv is not None:
            self.queued_kv -= 1
        self.running.pop(req.request_id, None)
        self._leave_awaiting_kv(req)

    @property
    def num_seqs(self) -> int:
        """Sequences that hold a slot of max_num_seqs: running, or admitted for remote KV."""
        return len(self.running) + len(self.awaiting_kv)

    def _leave_awaiting_kv(self, req: Request, *, required: bool = False) -> None:
        if self.awaiting_kv.pop(req.request_id, None) is not None:
            self.awaiting_kv_blocks -= self._awaiting_blocks.pop(req.request_id)
        elif required:
            raise KeyError(f"request {req.request_id} is not waiting for remote KV")

    def check_accounts(self) -> None:
        """The admission bounds hold and the awaiting-KV block count adds up (the
        simulators call this after every event; it scans, so never on a hot path)."""
        if self.num_seqs > self.config.max_num_seqs:
            raise AssertionError(f"{self.num_seqs} sequences admitted; max_num_seqs is "
                                 f"{self.config.max_num_seqs}")
        queued = sum(r.remote_kv is not None for r in self.waiting.values())
        if queued != self.queued_kv or queued > self.config.kv_queue_bound:
            raise AssertionError(f"{queued} pulled requests queued, counted {self.queued_kv}; "
                                 f"the bound is {self.config.kv_queue_bound}")
        taken = self._awaiting_blocks
        if taken.keys() != self.awaiting_kv.keys() or sum(taken.values()) != \
                self.awaiting_kv_blocks:
            raise AssertionError(f"awaiting-KV block counts {taken} do not add up to "
                                 f"{self.awaiting_kv_blocks} for {list(self.awaiting_kv)}")
        for rid, req in self.awaiting_kv.items():
            if len(req.block_ids) > taken[rid]:
                raise AssertionError(f"{rid} holds {len(req.block_ids)} blocks; it took "
                                     f"{taken[rid]} at admission")

    def has_pending(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks ----------------------------------------------------------------
    def free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids, req.owner)
            # A new list: an in-flight batch may still hold the old one (never
            # mutated after this point, see the fence in the engine).
            req.block_ids = []
        req.num_published = 0

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.config.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.block_ids.extend(self.pool.allocate(need, req.owner))
        return True

    def _preempt(self, req: Request) -> None:
        self.free_blocks(req)
        req.num_computed_tokens = 0
        req.transition(Event.PREEMPT)
        del self.running[req.request_id]
        self.waiting[req.request_id] = req
        self.waiting.move_to_end(req.request_id, last=False)
        self.num_preemptions += 1

    def _pick_victim(self, needing: Request) -> Request | None:
        for victim in reversed(self.running.values()):
            if victim is not needing and victim.in_flight == 0:
                return victim
        return None

    # -- one step ----------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self.config.max_num_batched_tokens
        victims_left = True
        for req in list(self.running.values()):
            if budget == 0:
                break
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            n = self._tokens_to_compute(req, budget)
            if n == 0:
                continue
            end = req.num_computed_tokens + n
            while not self._grow(req, end):
                victim = self._pick_victim(req) if victims_left else None
                if victim is None:
                    victims_left = False
                    break
                self._preempt(victim)
            else:
                self._add_to_batch(batch, req, n)
                budget -= n
                continue
            if req.in_flight == 0:
                self._preempt(req)
        self._admit(batch, budget)
        return batch

    def _admit(self, batch: Batch, budget: int) -> None:
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and self.num_seqs < max_seqs:
            req = next(iter(self.waiting.values()))
            if req.remote_kv is not None:
                if not self._admit_remote(req):
                    break
                continue
            n = self._admit_local(req, budget)
            if n == 0:
                break  # FCFS: nobody overtakes the head of the queue
            req.transition(Event.SCHEDULE)
            self.running[req.request_id] = req
            self._add_to_batch(batch, req, n)
            budget -= n

    def _admit_local(self, req: Request, budget: int) -> int:
        """Give the head of the queue its cached prefix and blocks for its first chunk;
        the chunk's size, or 0 (nothing changed) when the blocks are not there."""
        hits = self._prefix_hits(req)
        start = len(hits) * self.config.block_size
        n = min(req.num_tokens_scheduled_to_exist - start, budget)
        need = self.config.blocks_for(start + n) - len(hits)
        if not self.pool.can_allocate(need, reusing=hits):
            return 0
        self.waiting.popitem(last=False)
        self._share_hits(req, hits, queried=req.num_tokens_scheduled_to_exist)
        req.num_computed_tokens = start
        grown = self._grow(req, start + n)
        assert grown, "can_allocate said the blocks were there"
        return n

    def _prefix_hits(self, req: Request) -> list[int]:
        """Published blocks holding a prefix of the request's known tokens, leaving at
        least one token to compute."""
        if not self.caching or req.block_ids or req.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed (as vLLM)
        bs = self.config.block_size
        most = (req.num_tokens_scheduled_to_exist - 1) // bs
        extend_hashes(req.block_hashes, req.token_ids, bs, most, self._root)
        return self.pool.match(req.block_hashes[:most])

    def _share_hits(self, req: Request, hits: list[int], *, queried: int) -> None:
        """An admitted request takes one reference to each cached block of its prefix
        (``_prefix_hits``); ``queried`` tokens were looked up (counted in tokens, like
        vLLM's prefix cache stats)."""
        if not self.caching:
            return
        self.pool.share(hits, req.owner)
        req.block_ids = list(hits)
        req.num_published = len(hits)
        self.prefix_stats.queries += queried
        self.prefix_stats.hits += len(hits) * self.config.block_size

    def publish_computed(self, req: Request, end: int) -> None:
        """A completed step wrote the request's KV up to position ``end``: publish its
        blocks that are now full and computed."""
        if not (self.caching and req.shareable):
            return
        bs = self.config.block_size
        full = min(end, len(req.token_ids)) // bs
        if full <= req.num_published or full > len(req.block_ids):
            return
        extend_hashes(req.block_hashes, req.token_ids, bs, full, self._root)
        events, run = self.pool.events, req.num_published
        for i in range(req.num_published, full):
            took = self.pool.publish(req.block_ids[i], req.block_hashes[i], req.owner)
            if events is not None and not took:  # another block holds it: announced then
                self._record_stored(req, run, i)
                run = i + 1
        if events is not None:
            self._record_stored(req, run, full)
        req.num_published = full

    def _record_stored(self, req: Request, start: int, end: int) -> None:
        """KV events: blocks ``start .. end - 1`` of ``req`` are now in the cache."""
        assert self.pool.events is not None
        bs = self.config.block_size
        parent = req.block_hashes[start - 1] if start else None
        self.pool.events.stored(req.block_hashes[start:end], parent,
                                req.token_ids[start * bs:end * bs], bs)

    def _admit_remote(self, req: Request) -> bool:
        """Decode side: share the prompt's cached prefix, allocate the rest of its blocks
        and wait for the remote KV of those (a partial pull when the prefix hit)."""
        hits = self._prefix_hits(req)
        need = self.config.blocks_for(req.prompt_len) - len(hits)
        over_budget = self.awaiting_kv_blocks + len(hits) + need > \
            self.config.awaiting_kv_block_budget
        if (over_budget and self.awaiting_kv) or not self.pool.can_allocate(need, reusing=hits):
            return False  # FCFS: it waits for pulls in flight to land, or for blocks
        self.waiting.popitem(last=False)
        self.queued_kv -= 1
        self._share_hits(req, hits, queried=req.prompt_len)
        req.num_cached_blocks = len(hits)
        grown = self._grow(req, req.prompt_len)
        assert grown, "can_allocate said the blocks were there"
        req.transition(Event.AWAIT_KV)
        self.awaiting_kv[req.request_id] = req
        self._awaiting_blocks[req.request_id] = len(req.block_ids)
        self.awaiting_kv_blocks += len(req.block_ids)
        self.newly_awaiting_kv.append(req)
        return True

    def kv_loaded(self, req: Request, *, shareable: bool = True) -> None:
        """The prompt's KV is in the request's blocks (validated by the fence): decode
        from the first token; the prompt's full blocks are published at once, unless the
        KV is not ``shareable`` (its source is not authenticated): then the request
        publishes nothing, ever (its later blocks' KV attends over the pulled KV)."""
        self._leave_awaiting_kv(req, required=True)
        req.num_computed_tokens = req.prompt_len
        req.remote_kv = None  # the KV is ours now: a preemption recomputes it locally
        req.shareable = shareable
        self.running[req.request_id] = req
        self.publish_computed(req, req.prompt_len)

    def kv_load_failed(self, req: Request, recompute: bool) -> None:
        """Blocks freed once; with ``recompute`` the request prefills locally, first."""
        self._leave_awaiting_kv(req, required=True)
        self.free_blocks(req)
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        if recompute:
            req.remote_kv = None
            self.waiting[req.request_id] = req
            self.waiting.move_to_end(req.request_id, last=False)

    def _tokens_to_compute(self, req: Request, budget: int) -> int:
        total = req.num_tokens_scheduled_to_exist
        remaining = total - req.num_computed_tokens
        if remaining <= 0:
            return 0
        will_have = req.num_output_tokens + req.num_pending_samples
        if remaining == 1 and will_have >= req.params.max_tokens:
            return 0  # an in-flight sample will finish it; computing more is waste
        if req.remote_decode and req.num_pending_samples:
            return 0  # the prefill side samples one token only
        return min(remaining, budget)

    def _add_to_batch(self, batch: Batch, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        end = start + n
        known = len(req.token_ids)
        if end <= known:
            chunk = req.token_ids[start:end]
        else:
            chunk = req.token_ids[start:known] + [PLACEHOLDER] * (end - known)
        sample = end == req.num_tokens_scheduled_to_exist
        batch.requests.append(
            ScheduledRequest(
                request_id=req.request_id,
                token_ids=chunk,
                start=start,
                block_ids=req.block_ids,
                sample=sample,
                params=req.params,
                prompt_len=req.prompt_len,
                all_token_ids=req.token_ids,
            )
        )
        req.num_computed_tokens = end
        if sample:
            req.num_pending_samples += 1
        req.in_flight += 1
