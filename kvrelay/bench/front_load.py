"""The load generator of ``kvrelay bench front``: raw asyncio HTTP/1.1 keep-alive
connections, one per request in flight, so that the client costs little next to the
front it measures (httpx's client would cost more than the stub).

A target is a front (one request per client request) or nothing (``Direct``: the client
does the hand-off itself, P then D with P's lease, the legs a front sends; the "no
front" reference, with the engines' work the same). Each request's answer is checked:
status 200, and the text it must hold (``expect``) or, against real engines, tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvrelay.bench.serve import percentiles

PATH = "/v1/completions"


@dataclass
class Shot:
    """One client request: what came back and when (seconds from its start)."""

    ok: bool = False
    error: str = ""
    latency_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float | None = None  # streamed, two tokens or more


@dataclass(frozen=True)
class Direct:
    """No front: the client sends P the prefill leg, then D the decode leg."""

    prefill: str
    decode: str


class Conn:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, list[tuple[float, bytes]]]:
        """The status and the body's pieces as they arrived (monotonic time, bytes)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json"
                          b"\r\nContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self.host.encode(), self.port, len(data), data))
        try:
            return await self._read()
        except BaseException:
            self.close()
            raise

    async def _read(self) -> tuple[int, list[tuple[float, bytes]]]:
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
        pieces: list[tuple[float, bytes]] = []
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                pieces.append((time.monotonic(), chunk[:-2]))
        elif b"content-length" in headers:
            pieces.append((time.monotonic(),
                           await self.reader.readexactly(int(headers[b"content-length"]))))
        else:  # until the server closes
            pieces.append((time.monotonic(), await self.reader.read()))
            self.close()
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, pieces

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None


def _texts(pieces: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    """Each SSE event's choice text, with the time of the piece that completed it."""
    out, buf = [], b""
    for t, data in pieces:
        buf += data
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            payload = ev.strip()
            if not payload.startswith(b"data:") or payload == b"data: [DONE]":
                continue
            chunk = json.loads(payload[5:])
            if "error" in chunk:
                raise ValueError(f"error event: {chunk['error']}")
            for c in chunk.get("choices") or []:
                text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if text:
                    out.append((t, text))
    return out


def _whole_text(pieces: list[tuple[float, bytes]]) -> str:
    body = json.loads(b"".join(p for _, p in pieces))
    c = body["choices"][0]
    return str(c.get("text") or (c.get("message") or {}).get("content") or "")


class Client:
    """One request in flight at a time against a target, on connections of its own."""

    def __init__(self, target: str | Direct, stream: bool, expect: str | None,
                 timeout: float = 60.0) -> None:
        self.target, self.stream, self.expect = target, stream, expect
        self.timeout = timeout
        if isinstance(target, Direct):
            self.p, self.d = Conn(target.prefill), Conn(target.decode)
        else:
            self.p = self.d = Conn(target)

    async def one(self, body: dict[str, Any]) -> Shot:
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):  # TimeoutError is an OSError
                head: list[tuple[float, str]] = []
                if isinstance(self.target, Direct):
                    head, body = await self._prefill(body)
                status, pieces = await self.d.post(PATH, dict(body, stream=self.stream))
            if status != 200:
                raise ValueError(f"HTTP {status}: {b''.join(p for _, p in pieces)[:200]!r}")
            texts = head + (_texts(pieces) if self.stream
                            else [(pieces[-1][0], _whole_text(pieces))])
            return self._shot(t0, texts)
        except (OSError, ValueError, KeyError, IndexError, asyncio.IncompleteReadError) as exc:
            return Shot(error=f"{type(exc).__name__}: {exc}"[:300])

    async def _prefill(self, body: dict[str, Any]
                       ) -> tuple[list[tuple[float, str]], dict[str, Any]]:
        """P's token (as the client has it) and D's request, carrying P's lease."""
        p_body = dict(body, max_tokens=1, stream=False,
                      kv_transfer_params={"do_remote_decode": True})
        status, pieces = await self.p.post(PATH, p_body)
        if status != 200:
            raise ValueError(f"P: HTTP {status}: {b''.join(p for _, p in pieces)[:200]!r}")
        first = json.loads(b"".join(p for _, p in pieces))
        params = dict(first["kv_transfer_params"], first_token_sent=True)
        text = str(first["choices"][0].get("text") or "")
        return [(pieces[-1][0], text)], dict(body, kv_transfer_params=params)

    def _shot(self, t0: float, texts: list[tuple[float, str]]) -> Shot:
        got = "".join(t for _, t in texts)
        if self.expect is not None and got != self.expect:
            return Shot(error=f"wrong text: {got[:80]!r}")
        if not texts:
            return Shot(error="no tokens")
        end = texts[-1][0]
        tpot = ((end - texts[0][0]) / (len(texts) - 1)
                if self.stream and len(texts) > 1 else None)
        return Shot(ok=True, latency_s=time.monotonic() - t0, ttft_s=texts[0][0] - t0,
                    tpot_s=tpot)

    def close(self) -> None:
        self.p.close()
        self.d.close()


async def drive(target: str | Direct, body: dict[str, Any], *, stream: bool,
                concurrency: int, requests: int, seconds: float,
                expect: str | None) -> tuple[list[Shot], float]:
    """``requests`` requests (fewer if ``seconds`` pass first) at ``concurrency`` in
    flight; the shots and the wall time they took."""
    left = requests
    deadline = time.monotonic() + seconds
    shots: list[Shot] = []

    async def worker() -> None:
        nonlocal left
        client = Client(target, stream, expect)
        try:
            while left > 0 and time.monotonic() < deadline:
                left -= 1
                shots.append(await client.one(body))
        finally:
            client.close()

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return shots, time.monotonic() - t0


@dataclass
class Row:
    front: str
    mode: str
    concurrency: int
    shots: list[Shot]
    seconds: float
    cpu_s: float | None  # the front's CPU time over the row

    @property
    def ok(self) -> list[Shot]:
        return [s for s in self.shots if s.ok]

    @property
    def rate(self) -> float:
        return len(self.ok) / self.seconds if self.seconds else 0.0

    def ms(self, what: str, q: str) -> float:
        vals = [getattr(s, what) for s in self.ok if getattr(s, what) is not None]
        return 1e3 * percentiles(vals)[q]
