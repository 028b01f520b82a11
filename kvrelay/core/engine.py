"""The engine core: requests in, one step at a time, outputs out.

Pure and single-threaded: no clock, no I/O, no threads. The server's engine loop
and the simulator drive it through ``add_request``, ``abort_request``,
``schedule``/``complete`` (or ``step``, which does both) and ``take_outputs``.

The in-flight fence (DESIGN section 3): a step that was scheduled but has not
landed still reads and writes its requests' blocks. A step lands once its output is
applied (``complete``) and its device work is done (``Batch.completion``, set by the
runner: a CUDA event; already done on the CPU); steps land in the order they were
scheduled. A request that finishes or is aborted meanwhile is FINISHING: its terminal
output is emitted at once, its blocks stay until every step that references it has
landed, and only then does the one release run (or the hand-off to a lease, so a lease
is never offered before the step that wrote its blocks is done). Outputs of those
steps for it are dropped. Preemption waits for the same (``Request.in_flight``).

Async scheduling: ``step`` schedules and runs step N+1 before it applies step N's
output, so one step is always in flight between calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.config import SchedulerConfig
from kvrelay.core.block_pool import BlockPool, quarantine_owner
from kvrelay.core.kv_events import KvEvent, KvEventLog
from kvrelay.core.lifecycle import (
    TERMINAL_DECIDED,
    Event,
    Failure,
    FinishReason,
    RequestState,
)
from kvrelay.core.request import Request
from kvrelay.core.runner import Batch, Runner, SampledToken, StepToken, TokenLogprobs
from kvrelay.core.scheduler import RequestRejected, Scheduler
from kvrelay.sampling_params import SamplingParams

__all__ = ["Engine", "EngineStats", "LeaseHandle", "RequestOutput", "RequestRejected"]


class LeaseHandle(Protocol):
    """The lease a REMOTE_DECODE request's blocks moved to (the relay's KvTransferParams),
    opaque to the core: its two names give it back, ``to_dict`` is what the client gets."""

    @property
    def engine_id(self) -> str: ...
    @property
    def lease_id(self) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprobs] | None = None
    # params.prompt_logprobs: prompt tokens 1.. (on the first output only).
    prompt_logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    failure: Failure | None = None  # with finish reason ERROR: why, as a code
    # Prefill side, finish reason REMOTE_DECODE: the lease the decode side pulls
    # (set by the server's engine loop once the fence has handed the blocks over).
    lease: LeaseHandle | None = None
    # The request's first scheduled step, by the engine's clock (None without one).
    scheduled_at: float | None = None


@dataclass
class EngineStats:
    steps: int = 0
    # Events for requests already decided (late aborts, duplicate reports): no-ops.
    stale_events: int = 0
    # Sampled tokens of in-flight steps for requests that had finished meanwhile.
    dropped_samples: int = 0
    failed_steps: int = 0  # steps whose runner raised: their requests failed, the engine went on
    finished: dict[str, int] = field(default_factory=dict)


# Called instead of freeing when a prefill-side request finishes with
# REMOTE_DECODE: it must take ownership of ``request.block_ids`` (pool.transfer).
KvHandoff = Callable[[Request], None]


class Engine:
    def __init__(
        self,
        config: SchedulerConfig,
        runner: Runner,
        *,
        pool: BlockPool | None = None,
        kv_handoff: KvHandoff | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.pool = pool if pool is not None else BlockPool(config.num_blocks)
        self.scheduler = Scheduler(config, self.pool)
        self.kv_handoff = kv_handoff
        self.stats = EngineStats()
        # Optional: stamps each request's first scheduled step (a server's queue-time
        # metric). Set by whoever owns time; the simulators leave it unset.
        self.clock: Callable[[], float] | None = None
        # Every request not yet FINISHED (released), by id.
        self.requests: dict[str, Request] = {}
        self._in_flight: deque[tuple[Batch, Mapping[str, SampledToken]]] = deque()
        # Steps applied (or failed) whose device work may still write their requests'
        # blocks, oldest first; each still counts in its requests' ``in_flight``.
        self._landing: deque[Batch] = deque()
        self._outputs: list[RequestOutput] = []
        self._released_since_batch: list[str] = []

    # -- requests in -------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        remote_decode: bool = False,
        remote_kv: object | None = None,
        first_token: int | None = None,
    ) -> Request:
        """``remote_kv`` (decode side): the prompt's KV comes from a prefill engine,
        which sampled ``first_token``; it is a known token here, so the first decode
        step computes its KV and samples token 2."""
        if request_id in self.requests:
            raise RequestRejected("request_id", f"request id {request_id!r} is already in use")
        if (remote_kv is None) != (first_token is None):
            raise ValueError("remote_kv and first_token come together")
        self.scheduler.check_admissible(len(prompt_token_ids), params.max_tokens,
                                        pulled=remote_kv is not None)
        req = Request(
            request_id=request_id,
            prompt_len=len(prompt_token_ids),
            token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=frozenset(eos_token_ids),
            remote_decode=remote_decode,
            remote_kv=remote_kv,
        )
        self.requests[request_id] = req
        if first_token is not None:
            req.token_ids.append(first_token)
            reason = self._stop_reason(req, first_token)
            if reason is not None:  # the first token already completes it: no KV needed
                self._finish(req, reason)
                return req
        self.scheduler.add(req)
        return req

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None
    ) -> bool:
        """Finish a request now, in any state. Returns False (and counts a stale
        event) when it had already finished."""
        req = self.requests.get(request_id)
        if req is None or req.state in TERMINAL_DECIDED:
            self.stats.stale_events += 1
            return False
        self._finish(req, reason, error=error)
        return True

    # -- decode side: remote KV (the relay receiver drives these) ----------------
    def take_kv_waiting(self) -> list[Request]:
        """Requests admitted into WAITING_FOR_KV since the last call."""
        out, self.scheduler.newly_awaiting_kv = self.scheduler.newly_awaiting_kv, []
        return [r for r in out if r.state is RequestState.WAITING_FOR_KV]

    def kv_load_start(self, request_id: str) -> None:
        self.requests[request_id].transition(Event.LOAD_START)

    def kv_load_done(self, request_id: str, *, shareable: bool = True) -> None:
        """The remote KV is validated: the request decodes from its first token. Not
        ``shareable`` (pulled from a relay that could not be authenticated): the request
        never publishes blocks in the prefix cache."""
        req = self.requests[request_id]
        req.transition(Event.LOAD_DONE)
        self.scheduler.kv_loaded(req, shareable=shareable)

    def kv_load_failed(self, request_id: str, error: str, *, recompute: bool,
                       failure: Failure = Failure.KV_LOAD) -> None:
        """No valid KV arrived (and the transfer has stopped writing). Blocks are freed
        once; ``recompute`` prefills locally, otherwise the request ends with ERROR
        (``failure`` says whose fault)."""
        req = self.requests[request_id]
        req.transition(Event.LOAD_FAILED)
        self.scheduler.kv_load_failed(req, recompute)
        if not recompute:
            self._finish(req, FinishReason.ERROR, error=error, failure=failure)

    def kv_transfer_ended(self, request_id: str) -> None:
        """A request aborted while loading (DRAINING): its transfer stopped writing."""
        req = self.requests[request_id]
        req.transition(Event.TRANSFER_ENDED)
        self._release_if_fenced(req)

    def kv_quarantine(self, request_id: str) -> list[int]:
        """A transfer did not stop within its drain bound: the blocks it writes into
        (those after the request's locally cached prefix) move to a quarantine owner,
        where nothing reuses them, until ``kv_unquarantine``. The cached prefix blocks,
        which no transfer writes, stay with the request and go with its release."""
        req = self.requests[request_id]
        keep = req.num_cached_blocks
        ids, req.block_ids = req.block_ids[keep:], req.block_ids[:keep]
        self.pool.transfer(ids, req.owner, quarantine_owner(request_id))
        return ids

    def kv_unquarantine(self, request_id: str, block_ids: Sequence[int]) -> None:
        self.pool.free(block_ids, quarantine_owner(request_id))

    # -- stepping ----------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._in_flight) or bool(self._landing)

    def pending_completion(self) -> StepToken | None:
        """The token of the oldest applied step whose device work is not known to be
        done (None: there is none). A driver with nothing to schedule waits on it,
        outside any lock, rather than spin: the blocks it holds free when it is done."""
        return self._landing[0].completion if self._landing else None

    def schedule(self) -> Batch | None:
        """Schedule the next step and mark it in flight; None when nothing can run."""
        if self._landing:
            self._land()  # before preemption picks victims and admission counts blocks
        batch = self.scheduler.schedule()
        if not batch.requests:
            return None
        batch.finished_ids = self._released_since_batch
        self._released_since_batch = []
        self.stats.steps += 1
        if self.clock is not None:
            t = self.clock()
            for sr in batch.requests:
                req = self.requests[sr.request_id]
                if req.scheduled_at is None:
                    req.scheduled_at = t
        return batch

    def complete(self, batch: Batch, sampled: Mapping[str, SampledToken]) -> None:
        """Apply a step's output. Steps complete in the order they were scheduled."""
        landed = self._lands_now(batch)
        for sr in batch.requests:
            req = self.requests[sr.request_id]  # the fence keeps it until this point
            if landed:
                req.in_flight -= 1
            if req.state is RequestState.RUNNING:  # its KV up to here is written
                self.scheduler.publish_computed(req, sr.start + len(sr.token_ids))
            if sr.sample:
                req.num_pending_samples -= 1
                if req.state is RequestState.RUNNING:
                    self._append_token(req, sampled[sr.request_id])
                else:
                    self.stats.dropped_samples += 1
            self._release_if_fenced(req)
        if not landed:
            self._landing.append(batch)

    def step(self) -> list[RequestOutput]:
        """Schedule, run and apply one step. A runner exception propagates here (the
        simulators' invariant checks live in their runners); the server's loop calls
        ``schedule``, the runner and ``end_step`` itself, and fails only the step.
        With nothing to schedule it waits for the device work of earlier steps."""
        batch = self.schedule()
        sampled = self.runner.execute(batch) if batch is not None else None
        outputs = self.end_step(batch, sampled)
        token = self.pending_completion() if batch is None else None
        if token is not None:
            token.wait()
            self._land()
            outputs += self.take_outputs()
        return outputs

    def end_step(
        self,
        batch: Batch | None,
        sampled: Mapping[str, SampledToken] | None = None,
        *,
        error: BaseException | None = None,
    ) -> list[RequestOutput]:
        """Apply what the runner made of ``batch`` (from ``schedule``; None when nothing
        was scheduled): its samples, or the ``error`` it raised. The server's loop runs
        the runner between ``schedule`` and this call without holding the relay's lock."""
        if self._landing:
            self._land()
        if batch is not None and error is not None:
            self._fail_batch(batch, error)
        elif batch is not None:
            assert sampled is not None
            self._in_flight.append((batch, sampled))
        depth = 1 if self.config.async_scheduling else 0
        while self._in_flight and (len(self._in_flight) > depth or batch is None):
            done, samples = self._in_flight.popleft()
            self.complete(done, samples)
        return self.take_outputs()

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # -- KV events (kvrelay.core.kv_events) ----------------------------------------
    def record_kv_events(self, capacity: int) -> KvEventLog:
        """From now on the prefix cache's stores and evictions are recorded, at most
        ``capacity`` between two ``take_kv_events``."""
        self.pool.events = KvEventLog(capacity)
        return self.pool.events

    def take_kv_events(self) -> list[KvEvent]:
        """The KV events since the last take (none when not recording)."""
        return self.pool.events.take() if self.pool.events is not None else []

    # -- internals ---------------------------------------------------------------
    def _lands_now(self, batch: Batch) -> bool:
        """Whether ``batch``, being applied, lands at once: its device work is done and
        no older step is still landing. Steps land in order: on one device stream a
        later step cannot finish first, and the order keeps a step that wrote a block
        (later shared through the prefix cache) landed before any step after it."""
        if self._landing:
            self._land()
        return not self._landing and batch.completion.done()

    def _land(self) -> None:
        """Land the oldest steps whose device work is done: their requests may release."""
        landing = self._landing
        while landing and landing[0].completion.done():
            for sr in landing.popleft().requests:
                req = self.requests[sr.request_id]  # held by this step until now
                req.in_flight -= 1
                self._release_if_fenced(req)

    def _fail_batch(self, batch: Batch, error: BaseException) -> None:
        """The runner raised on this step: its requests end with an error, their blocks
        released on the one path (after any other in-flight step that holds them). The
        runner cannot say which request was at fault, so every request of the step fails;
        admission validates what it can so that no single request can cause this."""
        message = f"the model step failed: {type(error).__name__}: {error}"
        self.stats.failed_steps += 1
        landed = self._lands_now(batch)  # kernels it queued before raising may still run
        for sr in batch.requests:
            req = self.requests[sr.request_id]
            if landed:
                req.in_flight -= 1
            if sr.sample:
                req.num_pending_samples -= 1
            if req.state not in TERMINAL_DECIDED:
                self._finish(req, FinishReason.ERROR, error=message, failure=Failure.STEP)
            else:
                self._release_if_fenced(req)
        if not landed:
            self._landing.append(batch)

    def _append_token(self, req: Request, tok: SampledToken) -> None:
        req.token_ids.append(tok.token_id)
        reason = self._stop_reason(req, tok.token_id)
        if req.remote_decode and reason is not FinishReason.STOP:
            # The prefill side samples the first token only (the proxy asks for
            # max_tokens 1); unless it ended the sequence, the decode side goes on.
            reason = FinishReason.REMOTE_DECODE
        logprobs = [tok.logprobs] if tok.logprobs is not None else None
        if reason is not None:
            self._finish(req, reason, new_token=tok.token_id, logprobs=logprobs)
        else:
            self._outputs.append(
                RequestOutput(
                    req.request_id, [tok.token_id], req.prompt_len, req.num_output_tokens,
                    logprobs, scheduled_at=req.scheduled_at,
                )
            )
        if tok.prompt_logprobs is not None:
            self._outputs[-1].prompt_logprobs = tok.prompt_logprobs

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        params = req.params
        if token_id in req.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if len(req.token_ids) >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        *,
        error: str | None = None,
        failure: Failure | None = None,
        new_token: int | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        self.scheduler.remove(req)
        req.finish_reason = reason
        req.error = error
        req.transition(Event.FINISH)  # FINISHING, or DRAINING while a transfer writes
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        self._outputs.append(
            RequestOutput(
                req.request_id,
                [] if new_token is None else [new_token],
                req.prompt_len,
                req.num_output_tokens,
                logprobs,
                finished=True,
                finish_reason=reason,
                error=error,
                failure=failure,
                scheduled_at=req.scheduled_at,
            )
        )
        self._release_if_fenced(req)

    def _release_if_fenced(self, req: Request) -> None:
        if req.state is not RequestState.FINISHING or req.in_flight:
            return
        if req.finish_reason is FinishReason.REMOTE_DECODE and self.kv_handoff is not None:
            self.kv_handoff(req)  # ownership moves to a lease in one pool transfer
            req.block_ids = []
        else:
            self.scheduler.free_blocks(req)
        req.transition(Event.RELEASE)
        del self.requests[req.request_id]
        self._released_since_batch.append(req.request_id)
