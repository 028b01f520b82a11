"""uvicorn's server with a bounded, clean graceful shutdown that exits 0.

With a ``DrainState`` (the engines): the first SIGTERM/SIGINT starts a drain
(kvrelay.wire.drain): the port stays open, ``/health`` says draining, new generation
requests are refused, running ones finish. Once nothing is in flight and ``pending()``
says nothing is left (a prefill engine: no lease held), uvicorn's own shutdown runs. If
the grace period (``drain_after``) ends first, ``drain`` is called (the engine loop
aborts every request, so each response ends normally with finish reason ``abort``) and
the shutdown runs then; uvicorn's hard timeout only cancels what still hangs. The
lifespan shutdown then stops the engine loop.

Without one (the proxy): the signal starts uvicorn's shutdown at once (stop accepting,
let in-flight responses finish), and ``drain`` is called after ``drain_after``.

uvicorn re-raises the signal once it has shut down, so the process would die of
it; a graceful stop must exit 0 instead. A second SIGINT still forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from kvrelay.wire.drain import DrainState

log = logging.getLogger("kvrelay.serve")


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, *, drain: Callable[[], None], drain_after: float,
        state: DrainState | None = None, pending: Callable[[], str | None] = lambda: None,
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_after = drain_after
        self._state = state
        self._pending = pending
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self._state
        begun = self.should_exit or (state is not None and state.draining)
        if begun and sig == signal.SIGINT:
            self.force_exit = self.should_exit = True
        elif state is None:
            self.should_exit = True
        else:
            state.begin()  # no I/O in a signal handler: on_tick logs and decides

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        state = self._state
        if state is None or not state.draining:
            return False
        pending = await self._what_is_left(state)
        if not self._announced:
            self._announced = True
            log.info("draining for at most %.1f s: /health answers 503, new requests are "
                     "refused; waiting for %s", state.grace_s, pending or "nothing")
        if pending is None:
            log.info("drained in %.1f s: nothing in flight, nothing held",
                     state.grace_s - state.remaining())
            self.should_exit = True
        elif state.remaining() <= 0:
            log.warning("grace period (%.1f s) over with %s: aborting", state.grace_s, pending)
            self._drain()
            self.should_exit = True
        elif counter % 20 == 0:
            log.info("draining: %s (%.1f s of the grace period left)", pending,
                     state.remaining())
        return self.should_exit

    async def _what_is_left(self, state: DrainState) -> str | None:
        left = [f"{state.in_flight} requests in flight"] if state.in_flight else []
        pending = await asyncio.to_thread(self._pending)  # it may wait for the engine lock
        if pending:
            left.append(pending)
        return ", ".join(left) or None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # After a drain: what is left of the grace period (nothing, if it ran out).
        after = self._drain_after if self._state is None else self._state.remaining()
        timer = asyncio.get_running_loop().call_later(after, self._drain)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
