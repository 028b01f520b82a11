"""A stand-in prefill and decode engine for ``kvrelay bench front``: it speaks the P/D
contract of a kvrelay engine (and of vLLM's, as vllm-router drives it) and answers at
once, so that what a front in front of it costs is all that is measured.

One process, one event loop, two ports (P's and D's), a raw ``asyncio.Protocol`` per
connection: HTTP/1.1 with keep-alive, nothing else. The answers:

- P: a completion or chat request carrying ``kv_transfer_params: {do_remote_decode:
  true}`` gets one token and ``kv_transfer_params`` naming a lease;
- D: a request carrying the lease gets ``max_tokens`` tokens, less token 1 when the
  lease says ``first_token_sent`` (the proxy streamed P's), whole or as an SSE stream;
- a plain request (no lease either way) is answered as colocated work;
- ``POST /v1/kv/release``, ``GET /health``, ``GET /v1/models``: what a front polls or
  calls besides.

Run: ``python -m kvrelay.bench.front_stub P_PORT D_PORT``; it prints ``ready`` once both
ports listen. A framing error closes the connection; nothing a client sends stops it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from typing import Any

TOKEN = " t"  # every token's text: a client checks it got max_tokens of them
_leases = itertools.count()
_REASONS = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}


def _head(status: int, ctype: bytes, length: int | None) -> bytes:
    size = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    return (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s\r\n\r\n"
            % (status, _REASONS.get(status, b"Error"), ctype, size))


def whole(status: int, body: Any) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return _head(status, b"application/json", len(data)) + data


def _choice(chat: bool, n: int, finish: str | None, chunk: bool) -> dict[str, Any]:
    text = TOKEN * n
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    key = "delta" if chunk else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish}


def _envelope(chat: bool, chunk: bool, choices: list[Any]) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat \
        else "text_completion"
    return {"id": "stub", "object": obj, "created": 0, "model": "stub", "choices": choices}


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}


def answer(path: bytes, body: dict[str, Any]) -> bytes:
    """The whole HTTP response to a completion or chat request."""
    chat = path.endswith(b"/chat/completions")
    params = body.get("kv_transfer_params") or {}
    wanted = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    if params.get("do_remote_decode"):  # P: token 1 and a lease
        out = _envelope(chat, False, [_choice(chat, 1, "length", False)])
        out["usage"] = _usage(1)
        out["kv_transfer_params"] = {
            "lease_id": f"lease-{next(_leases)}", "engine_id": "stub", "relay": "127.0.0.1:1",
            "compat": "stub", "first_token": 42, "blocks": 1, "do_remote_prefill": True,
            "remote_engine_id": "stub", "remote_block_ids": [0], "remote_host": "127.0.0.1",
            "remote_port": 1}
        return whole(200, out)
    n = wanted - 1 if params.get("first_token_sent") else wanted  # D (or colocated)
    if not body.get("stream"):
        out = _envelope(chat, False, [_choice(chat, n, "length", False)])
        out["usage"] = _usage(wanted)
        return whole(200, out)
    events = [_envelope(chat, True, [_choice(chat, 1, "length" if i == n - 1 else None, True)])
              for i in range(n)]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(dict(_envelope(chat, True, []), usage=_usage(wanted)))
    parts = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
             for e in events] + [b"data: [DONE]\n\n"]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return _head(200, b"text/event-stream", None) + chunks + b"0\r\n\r\n"


def route(method: bytes, path: bytes, raw: bytes) -> bytes:
    path = path.split(b"?", 1)[0]
    if method == b"GET" and path == b"/health":
        return _head(200, b"text/plain", 0)
    if method == b"GET" and path == b"/v1/models":
        return whole(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
    if method == b"POST" and path == b"/v1/kv/release":
        return whole(200, {"released": True})
    if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
        try:
            body = json.loads(raw)
        except ValueError:
            return whole(400, {"error": {"message": "not JSON", "code": 400}})
        return answer(path, body)
    return whole(404, {"error": {"message": f"no route {path.decode()!r}", "code": 404}})


class StubProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, requests answered in order as they arrive whole."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].split(b"\r\n")
            method, path = lines[0].split(b" ", 2)[:2]
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (ln.partition(b":") for ln in lines[1:])}
            start = end + 4
            if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                body = _dechunk(self.buf, start)
                if body is None:
                    return
                raw, start = body
            else:
                length = int(headers.get(b"content-length", b"0"))
                if len(self.buf) < start + length:
                    return
                raw, start = self.buf[start:start + length], start + length
            self.buf = self.buf[start:]
            self.transport.write(route(method, path, raw))


def _dechunk(buf: bytes, at: int) -> tuple[bytes, int] | None:
    """A chunked body from ``at``: (body, end), or None while it is incomplete."""
    out = []
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(buf[at:eol].split(b";")[0], 16)
        if len(buf) < eol + 2 + size + 2:
            return None
        out.append(buf[eol + 2:eol + 2 + size])
        at = eol + 2 + size + 2
        if size == 0:
            return b"".join(out), at


async def serve(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(StubProtocol, "127.0.0.1", p, backlog=1024)
               for p in ports]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(serve([int(p) for p in sys.argv[1:]]))
