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
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.core.engine import Engine, RequestOutput, RequestRejected
from kvrelay.core.lifecycle import FinishReason
from kvrelay.sampling_params import SamplingParams

log = logging.getLogger(__name__)

OutputQueue = asyncio.Queue[RequestOutput]


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


_Command = _Add | _Abort | _Stop | _Drain


@dataclass
class LoopStats:
    steps: int = 0
    added: int = 0
    rejected: int = 0
    aborts_sent: int = 0
    dead_reason: str | None = field(default=None)


class EngineLoop:
    """Runs ``engine`` in a dedicated thread; ``add``/``abort`` are safe from asyncio."""

    def __init__(self, engine: Engine, *, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
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
    ) -> None:
        """Hand a request to the engine; returns once it is accepted.

        Raises ``RequestRejected`` (naming the parameter) when the engine can never
        serve it, and ``EngineDead`` when the loop is not running.
        """
        if not self.alive:
            raise EngineDead(self.stats.dead_reason or "the engine is shutting down")
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cmd = _Add(request_id, prompt_token_ids, params, eos_token_ids, sink, accepted,
                   remote_decode)
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

    # -- the loop thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                engine = self.engine
                self._drain_commands(block=not engine.has_work())
                if self._stopping:
                    self._shutdown()
                    return
                if engine.has_work():
                    steps_before = engine.stats.steps
                    outputs = engine.step()
                    self._deliver(outputs)
                    self.stats.steps += 1
                    if engine.stats.steps == steps_before and not outputs:
                        # Nothing schedulable (cannot happen with a consistent core):
                        # wait for a command instead of spinning.
                        self._drain_commands(block=True)
        except Exception as exc:  # a runner or core failure: fail every request loudly
            log.exception("engine loop failed")
            self.stats.dead_reason = f"engine failure: {type(exc).__name__}: {exc}"
            self._stopping = True
            self._fail_all(self.stats.dead_reason)

    def _drain_commands(self, *, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else None
            if cmd is None:
                cmd = self._commands.get_nowait()
            while True:
                self._apply(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            self._apply_add(cmd)
        elif isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id, cmd.reason)
            self._deliver(self.engine.take_outputs())
        elif isinstance(cmd, _Drain):
            self._draining = True
            self._abort_all()
        else:
            self._stopping = True

    def _apply_add(self, cmd: _Add) -> None:
        error: BaseException | None = None
        if self._stopping or self._draining:
            error = EngineDead("the server is shutting down")
        else:
            try:
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params,
                    eos_token_ids=cmd.eos_token_ids, remote_decode=cmd.remote_decode,
                )
                self._sinks[cmd.request_id] = cmd.sink
                self.stats.added += 1
            except RequestRejected as exc:
                self.stats.rejected += 1
                error = exc
        self._call_async(_settle, cmd.accepted, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
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
        # Shutdown is not a hot path: a scan of what is left is fine here.
        engine = self.engine
        for request_id in list(engine.requests):
            engine.abort_request(request_id, FinishReason.ABORT)
        self._deliver(engine.take_outputs())

    def _shutdown(self) -> None:
        engine = self.engine
        self._abort_all()
        while engine.has_work():  # in-flight steps complete, then blocks are released
            self._deliver(engine.step())
        self._reject_pending_adds()

    def _fail_all(self, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            out = RequestOutput(
                request_id, [], 0, 0, finished=True, finish_reason=FinishReason.ERROR,
                error=message,
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
