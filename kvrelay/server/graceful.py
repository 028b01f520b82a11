"""uvicorn's server with a bounded, clean graceful shutdown that exits 0.

On SIGTERM/SIGINT uvicorn stops accepting and lets in-flight responses finish.
After ``drain_after`` seconds this server calls ``drain`` (the engine loop aborts
every request, so each response ends normally with finish reason ``abort``);
uvicorn's own hard timeout (set a little later) only cancels what still hangs.
Then the lifespan shutdown stops the engine loop.

uvicorn re-raises the signal once it has shut down, so the process would die of
it; a graceful stop must exit 0 instead. A second SIGINT still forces the exit.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, *, drain: Callable[[], None], drain_after: float
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_after = drain_after

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._drain_after, self._drain)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
