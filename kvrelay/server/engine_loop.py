"""The engine loop: one thread owns the engine; asyncio handlers talk to it by queue.

The engine core is pure and single-threaded, so exactly one thread touches it.
HTTP handlers (on the asyncio event loop) send commands through a thread-safe
queue; the loop thread drains the queue, steps the engine while it has work and
hands each step's outputs back with one ``call_soon_threadsafe`` per step, into
the asyncio queue of the HTTP request that owns each engine request.

Ownership of a request's output route (``_sinks``): registered when the engine
accepts the request, removed when its finished output is delivered. An abort of a
request that finished already is a counted no-op in the engine, nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.core.engine import Engine, RequestOutput, RequestRejected
from kvrelay.core.kv_events import KvEvent
from kvrelay.core.lifecycle import Failure, FinishReason
from kvrelay.core.runner import Batch
from kvrelay.core.scheduler import KvQueueFull
from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.relay.remote import RemoteKv
from kvrelay.sampling_params import SamplingParams

log = logging.getLogger(__name__)

OutputQueue = asyncio.Queue[RequestOutput]


class AdmissionFailed(RuntimeError):
    """Admitting a request raised unexpectedly: the request fails, the loop goes on."""


class EngineDead(RuntimeError):
    """The engine loop has stopped (shutdown or a runner failure); no new requests."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: Sequence[int]
    sink: OutputQueue
    accepted: asyncio.Future[None]
    remote_decode: bool = False
    remote_kv: RemoteKv | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str
    reason: FinishReason


@dataclass(slots=True)
class _Stop:
    pass


@dataclass(slots=True)
class _Drain:
    pass


@dataclass(slots=True)
class _Barrier:
    done: asyncio.Future[None]


_Command = _Add | _Abort | _Stop | _Drain | _Barrier


@dataclass
class LoopStats:
    steps: int = 0
    added: int = 0
    rejected: int = 0
    aborts_sent: int = 0
    dead_reason: str | None = field(default=None)


class LoopHooks:
    """What a role adds to the loop (kvrelay.server.disagg): nothing, when colocated.

    Everything here runs in the loop thread, under ``lock``, the lock the prefill
    side's relay server takes before it touches the lease table and so the pool.
    """

    lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    poll_s = 0.001  # how often to look at the relay while only it has work

    def busy(self) -> bool:
        """Relay work pending that the engine's own has_work does not see."""
        return False

    def add(self, engine: Engine, cmd: _Add) -> None:
        if cmd.remote_kv is not None:
            raise RequestRejected("kv_transfer_params", "this engine does not pull remote KV "
                                  "(start it with --role decode)")
        engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                           eos_token_ids=cmd.eos_token_ids, remote_decode=cmd.remote_decode)

    def abort(self, engine: Engine, request_id: str, reason: FinishReason) -> None:
        engine.abort_request(request_id, reason)

    def before_step(self) -> None:
        """Relay events in (replies, timers, finished transfers)."""

    def route(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs to deliver now (the prefill side holds back until the hand-off)."""
        return outputs

    def drain_pending(self) -> str | None:
        """What a draining server still waits for besides its requests (the prefill
        side: leases decode engines have yet to pull), or None. Any thread."""
        return None

    def exit_summary(self) -> str:
        """Appended to the log line of a stopped server (the prefill side: its leases)."""
        return ""


class KvEventSink(Protocol):
    """Where each step's KV events go (kvrelay.wire.kv_events.ZmqEventPublisher)."""

    def offer(self, events: list[KvEvent]) -> None:
        """Never blocks, never raises (called by the loop thread under the lock)."""

    def close(self) -> None: ...


class EngineLoop:
    """Runs ``engine`` in a dedicated thread; ``add``/``abort`` are safe from asyncio."""

    def __init__(
        self,
        engine: Engine,
        *,
        idle_poll_s: float = 0.5,
        hooks: LoopHooks | None = None,
        threads: int | None = None,
        kv_events: KvEventSink | None = None,
    ) -> None:
        """``threads``: OpenMP threads of the model's parallel regions on the loop thread
        (the count is per thread: ``kernel_choice.set_thread_count``); None leaves it.
        ``kv_events``: gets the engine's KV events after every step (the engine must be
        recording them: ``Engine.record_kv_events``); closed when the loop stops."""
        self.engine = engine
        self.kv_events = kv_events
        self._threads = threads
        self.hooks = hooks or LoopHooks()
        self.stats = LoopStats()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, OutputQueue] = {}  # loop thread only
        self._idle_poll_s = idle_poll_s
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False  # loop thread only: new requests are refused

    # -- called from the asyncio side ---------------------------------------------
    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: OutputQueue,
        *,
        eos_token_ids: Sequence[int] = (),
        remote_decode: bool = False,
        remote_kv: RemoteKv | None = None,
    ) -> None:
        """Hand a request to the engine; returns once it is accepted.

        Raises ``RequestRejected`` (naming the parameter) when the engine can never
        serve it, and ``EngineDead`` when the loop is not running.
        """
        if not self.alive:
            raise EngineDead(self.stats.dead_reason or "the engine is shutting down")
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cmd = _Add(request_id, prompt_token_ids, params, eos_token_ids, sink, accepted,
                   remote_decode, remote_kv)
        self._commands.put(cmd)
        try:
            await accepted
        except asyncio.CancelledError:
            # The client went away while the loop thread was admitting the request.
            self.abort(request_id)
            raise

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Abort a request, in whatever state it is; never blocks. Idempotent."""
        self.stats.aborts_sent += 1
        self._commands.put(_Abort(request_id, reason))

    async def settled(self) -> None:
        """Returns once the loop thread has applied every command sent before (aborts
        included) and every output it produced until then has reached its queue (one
        ``call_soon_threadsafe`` order). At once when the loop is not running."""
        if not self.alive:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.put(_Barrier(done))
        await done

    def drain(self) -> None:
        """Refuse new requests and abort every request in the engine (finish reason
        abort): the handlers then end their responses normally. Used when a graceful
        shutdown runs out of time."""
        self._commands.put(_Drain())

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything still in the engine, let in-flight steps drain, join."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("engine loop did not stop within %.1f s", timeout)
        elif self.kv_events is not None:
            self.kv_events.close()

    # -- the loop thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._threads:
                kernel_choice.set_thread_count(self._threads)
            hooks = self.hooks
            with hooks.lock:
                self._offer_kv_events()  # a new engine's first event: its cache is empty
            while True:
                engine = self.engine
                if hooks.busy() and not engine.has_work():
                    # Only the relay has work (a pull in flight): look again soon.
                    self._drain_commands(block=True, timeout=hooks.poll_s)
                else:
                    self._drain_commands(block=not engine.has_work())
                if self._stopping:
                    self._shutdown()
                    return
                with hooks.lock:
                    hooks.before_step()
                    if not engine.has_work():
                        self._offer_kv_events()
                        self._deliver(engine.take_outputs())
                        continue
                    steps_before = engine.stats.steps
                    batch = engine.schedule()
                # The forward runs without the lock, so the relay answers decode engines
                # while it runs. The pool still has one writer at a time: the relay
                # frees only lease blocks, the step touches only its requests' blocks,
                # and every change of ownership happens under the lock.
                sampled, error = self._execute(batch)
                with hooks.lock:
                    outputs = engine.end_step(batch, sampled, error=error)
                    device_tail = engine.pending_completion() if batch is None else None
                    self._offer_kv_events()
                self._deliver(outputs)
                self.stats.steps += 1
                if device_tail is not None:
                    # Nothing to run but blocks held for earlier steps' device work
                    # (a CUDA event): wait for it without the lock, then release them.
                    device_tail.wait()
                    continue
                if engine.stats.steps == steps_before and not outputs:
                    # Nothing schedulable: only requests waiting for remote KV (look
                    # at the relay again soon), or none (cannot happen with a
                    # consistent core). Wait for a command instead of spinning.
                    timeout = hooks.poll_s if hooks.busy() else None
                    self._drain_commands(block=True, timeout=timeout)
        except Exception as exc:  # a runner or core failure: fail every request loudly
            log.exception("engine loop failed")
            self.stats.dead_reason = f"engine failure: {type(exc).__name__}: {exc}"
            self._stopping = True
            self._fail_all(self.stats.dead_reason)

    def _offer_kv_events(self) -> None:
        # Under the lock, where every change of the pool (and so of its record) happens.
        if self.kv_events is not None:
            self.kv_events.offer(self.engine.take_kv_events())

    def _execute(self, batch: Batch | None) -> tuple[Any, BaseException | None]:
        if batch is None:
            return None, None
        try:
            return self.engine.runner.execute(batch), None
        except Exception as exc:  # fails this step's requests; the loop goes on
            log.exception("model step of %d requests failed", len(batch.requests))
            return None, exc

    def _drain_commands(self, *, block: bool, timeout: float | None = None) -> None:
        try:
            wait = self._idle_poll_s if timeout is None else timeout
            cmd = self._commands.get(timeout=wait) if block else None
            if cmd is None:
                cmd = self._commands.get_nowait()
            while True:
                self._apply(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, cmd: _Command) -> None:
        with self.hooks.lock:
            self._apply_locked(cmd)

    def _apply_locked(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            self._apply_add(cmd)
        elif isinstance(cmd, _Abort):
            self.hooks.abort(self.engine, cmd.request_id, cmd.reason)
            self._deliver(self.engine.take_outputs())
        elif isinstance(cmd, _Drain):
            self._draining = True
            self._abort_all()
        elif isinstance(cmd, _Barrier):
            self._call_async(_settle, cmd.done, None)
        else:
            self._stopping = True

    def _apply_add(self, cmd: _Add) -> None:
        error: BaseException | None = None
        if self._stopping or self._draining:
            error = EngineDead("the server is shutting down")
        else:
            try:
                self.hooks.add(self.engine, cmd)
                self._sinks[cmd.request_id] = cmd.sink
                self.stats.added += 1
            except (RequestRejected, KvQueueFull) as exc:
                self.stats.rejected += 1
                error = exc
            except Exception as exc:  # a bug admitting one request must not stop the loop
                log.exception("admitting request %s failed", cmd.request_id)
                self.stats.rejected += 1
                self.hooks.abort(self.engine, cmd.request_id, FinishReason.ERROR)
                self.engine.take_outputs()  # nobody listens for this request yet
                error = AdmissionFailed(f"the request could not be admitted: "
                                        f"{type(exc).__name__}: {exc}")
        self._call_async(_settle, cmd.accepted, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        outputs = self.hooks.route(outputs)
        if not outputs:
            return
        routed: list[tuple[OutputQueue, RequestOutput]] = []
        for out in outputs:
            sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(
                out.request_id
            )
            if sink is not None:
                routed.append((sink, out))
        if routed:
            self._call_async(_put_all, routed)

    def _abort_all(self) -> None:
        # Shutdown is not a hot path: a scan of what is left is fine here. Through the
        # hooks: a request loading remote KV must drain, and its lease be reported.
        engine = self.engine
        for request_id in list(engine.requests):
            self.hooks.abort(engine, request_id, FinishReason.ABORT)
        self._deliver(engine.take_outputs())

    def _shutdown(self, grace_s: float = 10.0) -> None:
        engine, hooks = self.engine, self.hooks
        with hooks.lock:
            self._abort_all()
        deadline = time.monotonic() + grace_s
        # In-flight steps complete and transfers drain, then blocks are released once.
        while (engine.has_work() or hooks.busy()) and time.monotonic() < deadline:
            with hooks.lock:
                hooks.before_step()
                outputs = engine.step() if engine.has_work() else engine.take_outputs()
            self._deliver(outputs)
            if not outputs:
                time.sleep(hooks.poll_s)
        self._reject_pending_adds()

    def _fail_all(self, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            out = RequestOutput(
                request_id, [], 0, 0, finished=True, finish_reason=FinishReason.ERROR,
                error=message, failure=Failure.ENGINE,
            )
            self._call_async(_put_all, [(sink, out)])
        self._sinks.clear()
        self._reject_pending_adds()

    def _reject_pending_adds(self) -> None:
        try:
            while True:
                cmd = self._commands.get_nowait()
                if isinstance(cmd, _Add):
                    self._call_async(_settle, cmd.accepted, EngineDead("the engine has stopped"))
        except queue.Empty:
            return

    def _call_async(self, fn: object, *args: object) -> None:
        assert self._aio is not None
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._aio.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():  # the HTTP handler was cancelled meanwhile
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _put_all(routed: list[tuple[OutputQueue, RequestOutput]]) -> None:
    for sink, out in routed:
        sink.put_nowait(out)
