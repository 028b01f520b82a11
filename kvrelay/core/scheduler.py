"""Continuous batching: admission, chunked prefill, recompute preemption.

The scheduler decides which requests compute which tokens in the next step and
keeps each request's block table large enough for them. It owns the waiting and
running queues (insertion-ordered dicts: FCFS iteration, O(1) removal by id).

``free_blocks`` is the one path from a request's blocks back to the pool; the
engine calls it for release, the scheduler for preemption.

Preemption never touches a request that an in-flight step still references
(async scheduling): such a step may still read or write its blocks. When no
victim is free to take, the request that needs blocks waits a step instead.
"""

from __future__ import annotations

from collections import OrderedDict

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool
from kvrelay.core.lifecycle import Event, RequestState
from kvrelay.core.request import Request
from kvrelay.core.runner import PLACEHOLDER, Batch, ScheduledRequest


class RequestRejected(ValueError):
    """A request the engine can never serve; ``param`` names the offending input."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: dict[str, Request] = {}
        # Decode side: admitted with blocks, waiting for (or loading) remote KV.
        self.awaiting_kv: dict[str, Request] = {}
        self.newly_awaiting_kv: list[Request] = []
        self.num_preemptions = 0
        self._next_step_id = 0

    # -- admission -------------------------------------------------------------
    def check_admissible(self, prompt_len: int, max_tokens: int) -> None:
        cfg = self.config
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

    def remove(self, req: Request) -> None:
        self.waiting.pop(req.request_id, None)
        self.running.pop(req.request_id, None)
        self.awaiting_kv.pop(req.request_id, None)

    def has_pending(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks ----------------------------------------------------------------
    def free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids, req.owner)
            # A new list: an in-flight batch may still hold the old one (never
            # mutated after this point, see the fence in the engine).
            req.block_ids = []

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
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = next(iter(self.waiting.values()))
            if req.remote_kv is not None:
                if not self._admit_remote(req):
                    break
                continue
            n = min(req.num_tokens_scheduled_to_exist - req.num_computed_tokens, budget)
            if not self._grow(req, n):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popitem(last=False)
            req.transition(Event.SCHEDULE)
            self.running[req.request_id] = req
            self._add_to_batch(batch, req, n)
            budget -= n

    def _admit_remote(self, req: Request) -> bool:
        """Decode side: allocate the prompt's blocks and wait for the remote KV."""
        if not self._grow(req, req.prompt_len):
            return False
        self.waiting.popitem(last=False)
        req.transition(Event.AWAIT_KV)
        self.awaiting_kv[req.request_id] = req
        self.newly_awaiting_kv.append(req)
        return True

    def kv_loaded(self, req: Request) -> None:
        """The prompt's KV is in the request's blocks: decode from the first token."""
        del self.awaiting_kv[req.request_id]
        req.num_computed_tokens = req.prompt_len
        req.remote_kv = None  # the KV is ours now: a preemption recomputes it locally
        self.running[req.request_id] = req

    def kv_load_failed(self, req: Request, recompute: bool) -> None:
        """Blocks freed once; with ``recompute`` the request prefills locally, first."""
        del self.awaiting_kv[req.request_id]
        self.free_blocks(req)
        req.num_computed_tokens = 0
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
            )
        )
        req.num_computed_tokens = end
        if sample:
            req.num_pending_samples += 1
        req.in_flight += 1
