"""A decode engine that closes the proxy's connection before answering a streamed leg.

The flake of tests/e2e/test_drain.py (a client's stream ended "the decode engine URL
failed mid-stream: ReadError: "): a draining engine, its drain done, shuts down and
closes its idle keep-alive connections; the proxy had just sent a leg on one of them,
from its pool. uvicorn closes only a connection with no request in hand (one it has
read gets its answer: 503 while draining), so the leg was never read, the lease never
touched. The proxy must hand it to the next decode engine as it does a refused
connection or a 503, not end the client's stream with an error.

Here the engines are bare HTTP/1.1 servers on real sockets: a prefill engine that
answers token 1 and a lease, a decode engine that answers the proxy's health check
(the proxy keeps that connection) and then closes the connection under the leg sent on
it, reset (its request unread: the ReadError) or closed (read: "Server disconnected
without sending a response"), and a decode engine that streams the rest. A decode
engine that fails after its status line keeps the leg: the lease is its own by then.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

import httpx
import pytest

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
    (200 and one event, then a reset). ``posts``: (path, body, number of the request
    on its connection); ``checked``: set once a health check was answered."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
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
            _answer(writer, FIRST if path == "/v1/completions" else {"status": "ok"})
            await writer.drain()
            return True
        if self.mode == "refuse_lease":  # the lease another attempt holds or consumed
            _answer(writer, REFUSED, 400)
            await writer.drain()
            return True
        if not body.get("stream"):
            _answer(writer, WHOLE)
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        events = STREAM[:1] if self.mode == "fail_after_status" else STREAM
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


async def _asked(p: Engine, d1: Engine, d2: Engine, stream: bool = True) -> httpx.Response:
    """The client's answer to BODY (streamed or not) through a proxy in front of P, D1
    and D2 (D1 routed first: the least loaded, listed first), sent once its health check
    has been through all three (its connection to D1 back in its pool)."""
    urls = [await e.start() for e in (p, d1, d2)]
    proxy = Proxy(urls[:1], urls[1:], health_interval=3600)
    app = create_proxy_app(proxy)
    body = BODY if stream else {k: v for k, v in BODY.items() if not k.startswith("stream")}
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


async def _streamed(p: Engine, d1: Engine, d2: Engine) -> list[Any]:
    r = await _asked(p, d1, d2)
    assert r.status_code == 200, r.text
    return [json.loads(line[5:]) for line in r.text.splitlines()
            if line.startswith("data:") and line != "data: [DONE]"]


@pytest.mark.parametrize("close", ["reset", "close"])
def test_a_leg_closed_before_its_answer_goes_to_the_next_decode_engine(close: str) -> None:
    p, d1, d2 = Engine("prefill"), Engine(close), Engine("stream")
    events = asyncio.run(_streamed(p, d1, d2))
    assert not [e for e in events if "error" in e], events
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == " a b c" and events[-1]["usage"]["completion_tokens"] == 3, events
    # D1 had the leg on the connection its health check had used, and closed it.
    assert [(path, n) for path, _, n in d1.posts] == [("/v1/completions", 2)]
    # D2 got the lease as P made it; it is D2's now: P is not asked to release it.
    [(path, body, _)] = d2.posts
    assert path == "/v1/completions"
    assert body["kv_transfer_params"] == {**LEASE, "first_token_sent": True}
    assert [path for path, _, _ in p.posts] == ["/v1/completions"]


def test_a_leg_whose_engine_fails_after_its_status_line_is_not_handed_on() -> None:
    """After D's 200 the lease is D's (it may be pulling it): the stream ends with an
    error event and no other decode engine is asked."""
    p, d1, d2 = Engine("prefill"), Engine("fail_after_status"), Engine("stream")
    events = asyncio.run(_streamed(p, d1, d2))
    assert "failed mid-stream" in events[-1]["error"]["message"], events
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == " a b"
    assert len(d1.posts) == 1 and d2.posts == []


@pytest.mark.parametrize("close", ["reset", "close"])
def test_a_whole_answer_closed_before_it_goes_to_the_next_decode_engine(close: str) -> None:
    """Not streamed: the same close (a drained engine's, its leg unread) hands the leg on;
    the client gets D2's answer, not a 502."""
    p, d1, d2 = Engine("prefill"), Engine(close), Engine("stream")
    r = asyncio.run(_asked(p, d1, d2, stream=False))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == " a b c" and r.json()["usage"]["completion_tokens"] == 3
    assert [(path, n) for path, _, n in d1.posts] == [("/v1/completions", 2)]
    [(path, body, _)] = d2.posts
    assert path == "/v1/completions" and not body.get("stream")
    assert body["kv_transfer_params"] == {**LEASE, "first_token_sent": True}
    assert [path for path, _, _ in p.posts] == ["/v1/completions"]  # D2's lease: no release


@pytest.mark.parametrize("stream", [True, False])
def test_a_lease_lost_with_a_closed_engine_is_a_502_not_the_clients_error(stream: bool) -> None:
    """D1 read the leg and closed without answering (it died mid-decode, say): its
    attempt holds or consumed the lease, so D2's ACQUIRE is refused and D2 answers 400
    on kv_transfer_params. The client did nothing wrong: it gets a 502 (an error event
    when streamed) that names D1's close and D2's refusal."""
    p, d1, d2 = Engine("prefill"), Engine("close"), Engine("refuse_lease")
    r = asyncio.run(_asked(p, d1, d2, stream=stream))
    if stream:
        assert r.status_code == 200, r.text
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        error = events[-1]["error"]
    else:
        assert r.status_code == 502, r.text
        error = r.json()["error"]
    assert error["type"] == "server_error", error
    assert "closed the connection before answering" in error["message"], error
    assert "lease already consumed" in error["message"], error
    assert len(d1.posts) == 1 and len(d2.posts) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_lease_refused_without_a_close_stays_the_clients_400(stream: bool) -> None:
    """Params the client sent that no engine lost (a replayed lease): D's 400 as it is."""
    p, d1, d2 = Engine("prefill"), Engine("refuse_lease"), Engine("stream")
    r = asyncio.run(_asked(p, d1, d2, stream=stream))
    if stream:
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        assert events[-1]["error"] == REFUSED["error"], events
    else:
        assert r.status_code == 400 and r.json() == REFUSED, r.text
    assert len(d1.posts) == 1 and d2.posts == []
