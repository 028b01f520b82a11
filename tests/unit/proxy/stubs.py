"""Bare HTTP/1.1 engines on real sockets for the proxy's unit tests: a prefill engine that
answers token 1 and a lease, decode engines that stream, close or refuse, and the
client's answer through a real proxy app in front of them."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

import httpx

from kvrelay.proxy.app import create_proxy_app
from kvrelay.proxy.routing import Proxy

LEASE = {"lease_id": "ab" * 16, "relay": "127.0.0.1:1", "engine_id": "p-1",
         "block_ids": [3], "num_tokens": 2, "first_token": 7, "compat": "c"}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}


def _chunk(text: str, finish: str | None) -> dict[str, Any]:
    return {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish}], "usage": None}


STREAM = [_chunk(" b", None), _chunk(" c", "length"),
          {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "m",
           "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3,
                                    "total_tokens": 5}}]
WHOLE = {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " b c", "logprobs": None, "finish_reason": "length"}],
         "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
# What a decode engine answers when ACQUIRE is refused as the client's error
# (kvrelay.server.generation: ApiError(400, ..., param="kv_transfer_params")).
REFUSED = {"error": {"message": "invalid kv_transfer_params: lease already consumed (done)",
                     "type": "invalid_request_error", "param": "kv_transfer_params",
                     "code": 400}}
FIRST = {"id": "cmpl-p", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length"}],
         "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
         "kv_transfer_params": LEASE}


class Engine:
    """``/health`` answers 200 and keeps the connection; a POST is answered by ``mode``:
    ``prefill`` (token 1 and the lease; a release: ok), ``stream`` (D's tokens),
    ``reset``/``close`` (the connection closed before any answer), ``fail_after_status``
    (200 and one event, or part of a whole answer, then a reset). ``posts``: (path,
    body, number of the request on its connection); ``checked``: set once a health
    check was answered."""

    def __init__(self, mode: str, first: dict[str, Any] | None = None,
                 stream: list[dict[str, Any]] | None = None) -> None:
        self.mode = mode
        self.first = FIRST if first is None else first  # the prefill mode's answer
        self.stream = STREAM if stream is None else stream  # the stream mode's events
        self.posts: list[tuple[str, dict[str, Any], int]] = []
        self.checked = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.served: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        """Close the listener and every connection, and wait for their handlers."""
        assert self.server is not None
        self.server.close()
        for writer in self.served.values():
            writer.transport.abort()
        await asyncio.gather(*self.served)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.served[task] = writer
        try:
            for n in range(1, 1000):
                if not await self._one(reader, writer, n):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its connection
        writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   n: int) -> bool:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path, _ = head.split(" ", 2)
        if method == "GET":
            _answer(writer, {"status": "ok"})
            await writer.drain()
            self.checked.set()
            return True
        if self.mode == "reset":  # the request unread: the peer gets a reset
            self.posts.append((path, {}, n))
            _reset(writer)
            return False
        length = int(next(line.split(":", 1)[1] for line in head.split("\r\n")
                          if line.lower().startswith("content-length:")))
        body = json.loads(await reader.readexactly(length))
        self.posts.append((path, body, n))
        if self.mode == "close":
            writer.close()
            return False
        if self.mode == "prefill":
            _answer(writer, self.first if path == "/v1/completions" else {"status": "ok"})
            await writer.drain()
            return True
        if self.mode == "refuse_lease":  # the lease another attempt holds or consumed
            _answer(writer, REFUSED, 400)
            await writer.drain()
            return True
        if not body.get("stream"):
            if self.mode == "fail_after_status":  # the status line, half the body, a reset
                data = json.dumps(WHOLE).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(data), data[:10]))
                await writer.drain()
                _reset(writer)
                return False
            _answer(writer, WHOLE)
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        events = self.stream[:1] if self.mode == "fail_after_status" else self.stream
        for part in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            data = part.encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            if self.mode == "fail_after_status":
                _reset(writer)
                return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _answer(writer: asyncio.StreamWriter, doc: dict[str, Any], status: int = 200) -> None:
    data = json.dumps(doc).encode()
    reason = b"OK" if status == 200 else b"Bad Request"
    writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (status, reason, len(data), data))


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset, as a socket closed with its request unread is."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def asked(p: Engine, d1: Engine, d2: Engine, stream: bool = True,
                body: dict[str, Any] | None = None) -> httpx.Response:
    """The client's answer to BODY (updated by ``body``; streamed or not) through a proxy
    in front of P, D1 and D2 (D1 routed first: the least loaded, listed first), sent once
    its health check has been through all three (its connection to D1 back in its pool)."""
    urls = [await e.start() for e in (p, d1, d2)]
    proxy = Proxy(urls[:1], urls[1:], health_interval=3600)
    app = create_proxy_app(proxy)
    body = dict(BODY, **(body or {}))
    if not stream:
        body = {k: v for k, v in body.items() if not k.startswith("stream")}
    try:
        async with app.router.lifespan_context(app):
            await d2.checked.wait()  # the health loop asks P, D1, D2 in that order
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                r = await c.post("/v1/completions", json=body, timeout=30)
            # Its background work (a lease release to P, were there one) done before its
            # shutdown could cut it off: P's requests are then all it was sent.
            await asyncio.gather(*proxy._tasks)
            return r
    finally:
        for e in (p, d1, d2):
            await e.stop()
