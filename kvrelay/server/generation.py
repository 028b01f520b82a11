"""One HTTP request's generation: its engine requests (one per choice), their text.

The request side of the engine loop. It owns a single asyncio queue into which the
loop thread delivers the outputs of all of this request's engine requests, turns
token ids into text with an incremental detokenizer, ends a choice when a stop
string matches (and aborts that engine request so its blocks come back at once),
and records latency metrics as tokens arrive.

Invariant: every engine request this object added is either finished by the engine
or aborted by ``abort_unfinished``; the handlers call it in a ``finally``, so a
client that goes away (or a handler that is cancelled) never leaves a request
behind in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.core.engine import LeaseHandle, RequestOutput, RequestRejected
from kvrelay.core.lifecycle import Failure, FinishReason
from kvrelay.core.runner import TokenLogprobs
from kvrelay.core.scheduler import KvQueueFull
from kvrelay.relay.remote import RemoteKv
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.engine_loop import AdmissionFailed, EngineDead, EngineLoop
from kvrelay.server.metrics import ServerMetrics
from kvrelay.wire.http import ApiError


class Detokenizer(Protocol):
    stopped: bool

    def add(self, new_token_ids: Sequence[int]) -> str: ...

    def finish(self) -> str: ...


# (prompt token ids, the choice's params: stop strings and how they apply) -> a detokenizer
DetokenizerFactory = Callable[[Sequence[int], SamplingParams], Detokenizer]


@dataclass(slots=True)
class ChoiceSpec:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    remote_decode: bool = False  # prefill role: hand the KV to a lease after token 1
    remote_kv: RemoteKv | None = None  # decode role: pull the prompt's KV from here


@dataclass(slots=True)
class Delta:
    """New output of one choice: text, the tokens behind it, maybe the end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (first delta)


@dataclass(slots=True)
class _Choice:
    spec: ChoiceSpec
    request_id: str
    detok: Detokenizer
    num_tokens: int = 0
    queued_at: float = 0.0  # handed to the engine loop
    queue_observed: bool = False
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finish_reason: str | None = None


_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.REMOTE_DECODE: "remote_decode",
}


@dataclass
class Generation:
    loop: EngineLoop
    metrics: ServerMetrics
    make_detokenizer: DetokenizerFactory
    base_id: str
    eos_token_ids: Sequence[int] = ()
    # Engine parameter names as this endpoint calls them ("prompt" -> "messages").
    param_names: dict[str, str] = field(default_factory=dict)
    arrival: float = field(default_factory=time.monotonic)
    _queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    _choices: dict[str, _Choice] = field(default_factory=dict)
    _num_open: int = 0
    # Deltas produced at admission, before any engine output (see _add).
    _pending: list[Delta] = field(default_factory=list)
    # Prefill role: every lease made for a choice, so that a handler whose client left
    # can give them back (nobody else knows them).
    _leases: list[LeaseHandle] = field(default_factory=list)
    # Prefill role: told of each lease as soon as it reaches the handler, before any
    # answer is written (the proxy's release_key, see kvrelay.relay.release_keys).
    on_lease: Callable[[LeaseHandle], None] | None = None
    prompt_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices.values())

    async def start(self, specs: Sequence[ChoiceSpec], prompt_tokens: int) -> None:
        """Add every choice to the engine; on a rejection, undo and raise ApiError.

        Also undone when the handler is cancelled half-way (the client went away
        while some choices were already admitted)."""
        try:
            for spec in specs:
                await self._add(spec)
        except RequestRejected as exc:
            self.abort_unfinished()
            param = self.param_names.get(exc.param, exc.param)
            raise ApiError(400, str(exc), param=param) from exc
        except EngineDead as exc:
            self.abort_unfinished()
            raise ApiError(503, str(exc), type="server_error", code="unavailable") from exc
        except KvQueueFull as exc:
            # Nothing was admitted and the lease is untouched: the proxy tries another
            # decode engine, a client retries after Retry-After.
            self.abort_unfinished()
            raise ApiError(429, str(exc), type="server_error", code="kv_queue_full",
                           headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except AdmissionFailed as exc:
            self.abort_unfinished()
            raise ApiError(500, str(exc), type="server_error") from exc
        except BaseException:
            self.abort_unfinished()
            raise
        self.prompt_tokens = prompt_tokens

    async def _add(self, spec: ChoiceSpec) -> None:
        rid = f"{self.base_id}-{spec.index}"
        detok = self.make_detokenizer(spec.prompt_token_ids, spec.params)
        queued_at = time.monotonic()
        await self.loop.add(
            rid, spec.prompt_token_ids, spec.params, self._queue,
            eos_token_ids=self.eos_token_ids, remote_decode=spec.remote_decode,
            remote_kv=spec.remote_kv,
        )
        choice = _Choice(spec, rid, detok, queued_at=queued_at)
        self._choices[rid] = choice
        self._num_open += 1
        kv = spec.remote_kv
        if kv is None:
            # A pulled prompt was counted by the prefill engine that computed it.
            self.metrics.prompt_tokens.inc(len(spec.prompt_token_ids))
            self.metrics.request_prompt_tokens.observe(len(spec.prompt_token_ids))
            return
        # The prefill engine sampled token 1 (and counted it). The detokenizer needs it
        # either way, to emit the text that follows exactly as a colocated engine
        # would; it counts in usage: the request is one.
        text = detok.add([kv.first_token])
        choice.num_tokens = 1
        if not kv.first_token_sent:
            self._pending.append(self._first_delta(choice, text, kv.first_token))

    def _first_delta(self, choice: _Choice, text: str, token: int) -> Delta:
        """Token 1 sent by D itself: the proxy in front did not mark it as sent (vLLM's
        proxy discards P's answer). D has no logprobs for it: P computed the logits."""
        choice.first_token_at = choice.last_token_at = time.monotonic()
        self.metrics.ttft.observe(choice.first_token_at - self.arrival)
        delta = Delta(choice.spec.index, text, [token], None)
        if choice.detok.stopped:  # a stop string in the first token: nothing to decode
            self.loop.abort(choice.request_id, FinishReason.STOP)
            delta.finish_reason = "stop"
            self._finish(choice, "stop")
        return delta

    async def deltas(self) -> AsyncIterator[Delta]:
        pending, self._pending = self._pending, []
        for delta in pending:
            yield delta
        while self._num_open:
            out = await self._queue.get()
            applied = self._apply(out)
            if applied is not None:
                yield applied

    def drain_leases(self) -> list[LeaseHandle]:
        """Every lease made for this generation's choices (outputs already delivered
        but not consumed are applied first). For a handler whose client left."""
        while True:
            try:
                out = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            with contextlib.suppress(ApiError):
                self._apply(out)
        return list(self._leases)

    def abort_unfinished(self) -> None:
        for choice in self._choices.values():
            if choice.finish_reason is None:
                self.loop.abort(choice.request_id)
                self._finish(choice, "abort")

    # -- internals --------------------------------------------------------------------
    def _apply(self, out: RequestOutput) -> Delta | None:
        if out.lease is not None:
            # Kept even for a choice already given up (its client left as P finished):
            # the lease is made all the same, and only this handler can give it back.
            self._leases.append(out.lease)
            if self.on_lease is not None:
                self.on_lease(out.lease)
        choice = self._choices.get(out.request_id)
        if choice is None or choice.finish_reason is not None:
            return None  # e.g. the abort that follows a stop-string match
        if not choice.queue_observed and out.scheduled_at is not None:
            choice.queue_observed = True
            self.metrics.queue_time.observe(max(0.0, out.scheduled_at - choice.queued_at))
        if out.finish_reason is FinishReason.ERROR:
            self._finish(choice, "error")
            if out.failure is Failure.KV_PARAMS:
                raise ApiError(400, out.error or "invalid kv_transfer_params",
                               param="kv_transfer_params")
            raise ApiError(500, out.error or "the engine failed", type="server_error")
        text = ""
        if out.new_token_ids:
            self._record_tokens(choice, len(out.new_token_ids))
            text = choice.detok.add(out.new_token_ids)
        delta = Delta(choice.spec.index, text, out.new_token_ids, out.new_logprobs)
        delta.prompt_logprobs = out.prompt_logprobs
        if choice.detok.stopped:
            # A stop string ended the text: the engine request must end too, now. On
            # the prefill role the lease still goes back to the caller, who releases it.
            self.loop.abort(choice.request_id, FinishReason.STOP)
            delta.finish_reason = "stop"
            delta.kv_transfer_params = out.lease.to_dict() if out.lease else None
        elif out.finish_reason is FinishReason.REMOTE_DECODE:
            # Text held back (a split character, a possible stop string) is the
            # decode engine's to emit, once it knows the tokens that follow.
            delta.finish_reason = "remote_decode"
            delta.kv_transfer_params = out.lease.to_dict() if out.lease else None
        elif out.finished:
            delta.text += choice.detok.finish()
            assert out.finish_reason is not None
            delta.finish_reason = _REASONS.get(out.finish_reason, out.finish_reason.value)
        if delta.finish_reason is not None:
            self._finish(choice, delta.finish_reason)
        return delta

    def _record_tokens(self, choice: _Choice, n: int) -> None:
        t = time.monotonic()
        if choice.first_token_at is None:
            choice.first_token_at = t
            self.metrics.ttft.observe(t - self.arrival)
        else:
            self.metrics.itl.observe(t - choice.last_token_at)
        choice.last_token_at = t
        choice.num_tokens += n
        self.metrics.generation_tokens.inc(n)

    def _finish(self, choice: _Choice, reason: str) -> None:
        choice.finish_reason = reason
        self._num_open -= 1
        self.metrics.finished(reason)
        if reason != "remote_decode":  # P's part ends here, the request goes on on D
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
            self.metrics.request_generation_tokens.observe(choice.num_tokens)
