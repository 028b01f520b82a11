"""uvicorn's server, minus re-raising the signal after a graceful shutdown.

On SIGTERM/SIGINT uvicorn stops accepting, lets in-flight responses finish for up
to ``timeout_graceful_shutdown`` seconds, cancels the rest (their handlers abort
their engine requests), runs the lifespan shutdown (the engine loop aborts what
is left and stops) and then re-raises the signal, so the process dies of it. A
graceful stop must exit 0 instead; a second SIGINT still forces the exit.
"""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
