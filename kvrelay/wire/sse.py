"""Server-sent events that notice a client going away, and work cancelled when it
does: what the engine server and the proxy both stream with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Await ``work``; None when the client disconnects first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let ``work`` unwind (its finally blocks give resources back) before the
            # caller goes on; a cancel only becomes the task's state once it has run.
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A streaming response that notices a client going away even while it waits.

    Starlette only does so for ASGI < 2.4; with newer servers a disconnect shows up
    at the next write, which for a queued request may be minutes away. Here the
    disconnect cancels the body iterator at once. ``on_close`` runs however the
    response ends, also when the body iterator never started.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
