"""The proxy's upstream client closes every connection a cancelled call leaves behind.

Issue 21: the soak's proxy held sockets in CLOSE_WAIT to D (1 -> 10 in 30 minutes). A
call whose client leaves just as D's answer ends is cancelled while httpx closes the
response; httpcore shields that close from anyio's cancellation, not from asyncio's
``Task.cancel()``, so the close stops at its first await (the connection's state lock):
the connection stays ACTIVE, its request queued in the pool for ever, and once the
engine closes its side the proxy's socket sits in CLOSE_WAIT. Here the engine is a bare
asyncio server that answers one event stream and then closes its side, as an engine's
keep-alive timeout does; it sees whether the client ever closes its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import select

import httpx
import pytest

from kvrelay.proxy import sockets
from kvrelay.proxy.app import SweptTransport

BODY = b"data: 1\n\ndata: [DONE]\n\n"


class Engine:
    """Answers each request with ``BODY`` (chunked), then closes its side; ``closed`` is
    set once the client has closed its socket too. ``stalls``: the first answer stops
    after its first event, its side left open (an engine stopped mid-answer)."""

    def __init__(self, stalls: bool = False) -> None:
        self.stalls = stalls
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.stopping = False

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        stall, self.stalls = self.stalls, False
        part = BODY.split(b"\n\n")[0] + b"\n\n" if stall else BODY
        writer.write(b"%x\r\n%s\r\n" % (len(part), part) + (b"" if stall else b"0\r\n\r\n"))
        await writer.drain()
        if not stall:
            writer.write_eof()  # the engine's keep-alive timeout
        with contextlib.suppress(ConnectionError):  # a reset: closed with the end unread
            await reader.read()  # b"" once the client closed its socket
        if not self.stopping:
            self.closed.set()
        writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        self.stopping = True
        for w in self.writers:
            w.transport.abort()
        await self.server.wait_closed()


async def leave_as_the_answer_ends(client: httpx.AsyncClient, url: str) -> None:
    """Read the stream up to ``[DONE]`` and be cancelled then: the cancel lands in the
    response's close, at its first await (the proxy's leg task, cancelled as its client
    leaves while it closes D's finished stream)."""
    async with client.stream("POST", url + "/v1/completions", json={}) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                return


async def cancelled_twice_while_reading(client: httpx.AsyncClient, url: str) -> None:
    """Wait for the rest of a stalled stream and be cancelled there, then again as the
    read's own close runs (a cancel landing in that close: say a client leaving as the
    engine died mid-answer)."""
    first = asyncio.Event()
    call = asyncio.ensure_future(read_all(client, url, first))
    await asyncio.wait_for(first.wait(), timeout=10)  # the call is in the read by now
    call.cancel()  # in the read, waiting for the rest
    await asyncio.sleep(0)  # the call runs into the read's close, to its first await
    call.cancel()
    await call


async def read_all(client: httpx.AsyncClient, url: str, first: asyncio.Event) -> None:
    async with client.stream("POST", url + "/v1/completions", json={}) as r:
        async for line in r.aiter_lines():
            if line:
                first.set()


async def scenario(transport: httpx.AsyncBaseTransport, bound: float,
                   stalls: bool = False) -> bool:
    """Whether the client closed its socket to the engine within ``bound`` seconds, after
    a call cancelled in its response's close (``stalls``: in a read's close)."""
    engine = Engine(stalls)
    url = await engine.start()
    leave = cancelled_twice_while_reading if stalls else leave_as_the_answer_ends
    async with httpx.AsyncClient(transport=transport, timeout=10) as client:
        call = asyncio.ensure_future(leave(client, url))
        with pytest.raises(asyncio.CancelledError):
            await call
        try:
            await asyncio.wait_for(engine.closed.wait(), timeout=bound)
            closed = True
        except TimeoutError:
            closed = False
        # The pool still serves: the cancelled call left no request queued in it.
        async with client.stream("POST", url + "/v1/completions", json={}) as r:
            assert [line async for line in r.aiter_lines() if line][-1] == "data: [DONE]"
    await engine.stop()
    return closed


def test_httpx_pool_strands_a_socket_when_a_response_close_is_cancelled() -> None:
    """The bug this guards against, shown on httpx's own transport: the engine closed its
    side and the client never closes its own (CLOSE_WAIT for the client's life). If this
    fails, httpcore got fixed and SweptTransport's response wrapping may be dropped."""
    assert not asyncio.run(scenario(httpx.AsyncHTTPTransport(), bound=1.0))


def test_swept_transport_closes_the_socket_of_a_response_whose_close_was_cancelled() -> None:
    assert asyncio.run(scenario(SweptTransport(), bound=10.0))


def test_swept_transport_closes_the_socket_of_a_read_whose_close_was_cancelled() -> None:
    assert asyncio.run(scenario(SweptTransport(), bound=10.0, stalls=True))


def test_the_pools_readiness_check_sees_an_engine_close_its_side() -> None:
    """The proxy's network backend (kvrelay.proxy.sockets) answers httpcore's "did the
    engine close this idle connection?" as the anyio one does: not while it is open,
    yes once the engine closed it."""

    async def check() -> tuple[bool, bool]:
        closed = asyncio.Event()

        async def serve(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await closed.wait()
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stream = await sockets.Backend().connect_tcp("127.0.0.1", port, timeout=5)
        open_readable = stream.get_extra_info("is_readable")
        closed.set()
        sock = stream.get_extra_info("socket")
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: select.select([sock], [], [], 5))  # the engine's FIN, at most 5 s
        readable = stream.get_extra_info("is_readable")
        await stream.aclose()
        server.close()
        await server.wait_closed()
        return open_readable, readable

    assert asyncio.run(check()) == (False, True)
