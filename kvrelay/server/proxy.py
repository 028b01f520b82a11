"""The disaggregation proxy: one OpenAI-compatible front for prefill and decode engines.

Per request (DESIGN section 1):
1. pick a prefill engine and a decode engine, least outstanding requests among the
   healthy ones;
2. send the prefill engine the request with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params: {"do_remote_decode": true}``; it answers with the first
   token and the lease (``kv_transfer_params``);
3. stream that first token to the client at once (first-token seeding: the time to
   first token is the prefill's, not prefill + transfer + decode);
4. send the decode engine the original request plus the lease; it pulls the KV and
   streams tokens 2..n, and reports ``usage`` and ``finish_reason`` for the whole
   request.

A prefill engine that fails is retried on another; with none left the request goes
to a decode engine as plain colocated work. A client that goes away before the
decode engine has the request gets its lease released on the prefill engine
(``POST /v1/kv/release``); after that the decode engine, which sees the connection
close, aborts and tells the prefill engine itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvrelay.server.protocol import ApiError

log = logging.getLogger(__name__)

RELEASE_PATH = "/v1/kv/release"  # on the prefill engine


class UpstreamDown(Exception):
    """An engine did not answer (connection refused, reset, timeout, 5xx)."""


@dataclass(eq=False)
class Upstream:
    url: str
    role: str
    outstanding: int = 0
    healthy: bool = True


class Upstreams:
    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"at least one --{role} URL is required")
        self.all = [Upstream(u.rstrip("/"), role) for u in urls]

    def candidates(self) -> list[Upstream]:
        """The healthy by outstanding requests, then the rest: a failed health check is
        a hint (the engine may be back since), not a verdict. A handful of engines:
        sorting them per request is fine."""
        return sorted(self.all, key=lambda u: (not u.healthy, u.outstanding))

    def pick(self) -> Upstream | None:
        """Least outstanding among the healthy; None when none is healthy."""
        best = self.candidates()[0]
        return best if best.healthy else None


def error_body(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"
) -> JSONResponse:
    """The same OpenAI error body as the engines' (kvrelay.server.protocol.ApiError)."""
    return JSONResponse(ApiError(status, message, param=param, type=type_).body(),
                        status_code=status)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvrelay_proxy_requests", "Requests by path taken", ["path"], registry=r
        )
        self.prefill_failures = Counter(
            "kvrelay_proxy_prefill_failures", "Prefill engines that failed a request", registry=r
        )
        self.client_disconnects = Counter(
            "kvrelay_proxy_client_disconnects", "Clients that went away mid-request", registry=r
        )
        self.outstanding = Gauge(
            "kvrelay_proxy_outstanding",
            "Requests in flight per engine",
            ["role", "url"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvrelay_proxy_engine_healthy",
            "1 if the engine answers /health",
            ["role", "url"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvrelay_proxy_time_to_first_token_seconds",
            "Time to the first token as the client sees it",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )


class Proxy:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        *,
        api_key: str | None = None,
        health_interval: float = 2.0,
        timeout: float = 600.0,
    ) -> None:
        self.prefill = Upstreams("prefill", prefill)
        self.decode = Upstreams("decode", decode)
        self.api_key = api_key
        self.health_interval = health_interval
        self.timeout = timeout
        self.metrics = ProxyMetrics()
        self.client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    # -- plumbing ------------------------------------------------------------------
    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _http(self) -> httpx.AsyncClient:
        assert self.client is not None, "the proxy app is not running"
        return self.client

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def health_loop(self) -> None:
        while True:
            for up in self.prefill.all + self.decode.all:
                try:
                    r = await self._http().get(f"{up.url}/health", timeout=2.0)
                    up.healthy = r.status_code == 200
                except Exception:  # any failure: unhealthy, and the loop goes on
                    up.healthy = False
                self.metrics.healthy.labels(up.role, up.url).set(1 if up.healthy else 0)
            await asyncio.sleep(self.health_interval)

    @contextlib.asynccontextmanager
    async def _outstanding(self, up: Upstream) -> AsyncIterator[None]:
        up.outstanding += 1
        self.metrics.outstanding.labels(up.role, up.url).set(up.outstanding)
        try:
            yield
        finally:
            up.outstanding -= 1
            self.metrics.outstanding.labels(up.role, up.url).set(up.outstanding)

    # -- the request path ----------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_body(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_body(400, "the request body must be a JSON object")
        started = time.perf_counter()
        if body.get("n", 1) != 1 or body.get("logprobs") not in (None, False, 0):
            # Several choices or logprobs stay on one engine: nothing is handed over.
            self.metrics.requests.labels("colocated").inc()
            return await self._colocated(request, path, body)
        for attempt, up in enumerate(self.prefill.candidates()):
            try:
                first = await self._prefill(up, path, body)
            except UpstreamDown as exc:
                self.metrics.prefill_failures.inc()
                up.healthy = False
                log.warning("prefill engine %s failed (attempt %d): %s", up.url, attempt + 1, exc)
                continue
            up.healthy = True
            if isinstance(first, Response):
                return first  # the engine refused the request itself (4xx): pass it on
            self.metrics.requests.labels("disaggregated").inc()
            return await self._decode(request, path, body, first, started)
        self.metrics.requests.labels("prefill_unavailable").inc()
        return await self._colocated(request, path, body)

    async def _prefill(self, up: Upstream, path: str, body: dict[str, Any]) -> Any:
        p_body = dict(
            body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}
        )
        p_body.pop("stream_options", None)
        p_body.pop("max_completion_tokens", None)
        async with self._outstanding(up):
            try:
                r = await self._http().post(
                    f"{up.url}{path}", json=p_body, headers=self._headers(), timeout=self.timeout
                )
            except httpx.HTTPError as exc:
                raise UpstreamDown(str(exc)) from exc
        if r.status_code >= 500:
            raise UpstreamDown(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        first = r.json()
        first["_prefill_url"] = up.url
        return first

    async def _colocated(self, request: Request, path: str, body: dict[str, Any]) -> Response:
        up = self.decode.candidates()[0]
        return await self._forward(request, up, path, body)

    async def _decode(
        self,
        request: Request,
        path: str,
        body: dict[str, Any],
        first: dict[str, Any],
        started: float,
    ) -> Response:
        params = first.get("kv_transfer_params")
        choice = first["choices"][0]
        wanted = body.get("max_tokens", body.get("max_completion_tokens"))
        if params is None or choice.get("finish_reason") == "stop" or wanted == 1:
            # Finished on its first token: there is nothing to decode.
            if params is not None:
                await self._release(first["_prefill_url"], params)
            self.metrics.ttft.observe(time.perf_counter() - started)
            return self._as_response(body, first)
        up = self.decode.candidates()[0]
        d_body = dict(body, kv_transfer_params=params)
        stream = bool(body.get("stream"))
        if stream:  # the first token goes out now: that is the client's TTFT
            self.metrics.ttft.observe(time.perf_counter() - started)

        def release() -> Awaitable[None]:
            return self._release(first["_prefill_url"], params)

        response = await self._forward(request, up, path, d_body,
                                       first=first if stream else None, release=release)
        if not stream and response.status_code == 200 and isinstance(response, JSONResponse):
            merged = json.loads(bytes(response.body))
            c = merged["choices"][0]
            _set_text(c, _text_of(choice) + _text_of(c))
            self.metrics.ttft.observe(time.perf_counter() - started)
            return JSONResponse(merged)
        return response

    async def _release(self, prefill_url: str, params: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http().post(
                f"{prefill_url}{RELEASE_PATH}",
                json={"kv_transfer_params": params},
                headers=self._headers(),
                timeout=5.0,
            )

    def _as_response(self, body: dict[str, Any], first: dict[str, Any]) -> Response:
        first.pop("_prefill_url", None)
        first.pop("kv_transfer_params", None)
        for c in first["choices"]:
            if c.get("finish_reason") == "remote_decode":
                c["finish_reason"] = "length"  # the client asked for one token
        if not body.get("stream"):
            return JSONResponse(first)
        chunks = _chunks_from_full(first, body)

        async def gen() -> AsyncIterator[bytes]:
            for c in chunks:
                yield _sse(c)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def _forward(
        self,
        request: Request,
        up: Upstream,
        path: str,
        body: dict[str, Any],
        *,
        first: dict[str, Any] | None = None,
        release: Callable[[], Awaitable[None]] | None = None,
    ) -> Response:
        """Send ``body`` to ``up``; stream or return its answer. ``first``: a prefill
        answer whose token is streamed to the client before the engine's own."""
        client = self._http()
        req = client.build_request(
            "POST", f"{up.url}{path}", json=body, headers=self._headers(), timeout=self.timeout
        )
        if not body.get("stream"):
            async with self._outstanding(up):
                try:
                    r = await _unless_disconnected(request, client.send(req))
                except (httpx.HTTPError, _Disconnected) as exc:
                    if release is not None:
                        await release()
                    if isinstance(exc, _Disconnected):
                        self.metrics.client_disconnects.inc()
                        return Response(status_code=499)
                    return error_body(502, f"the decode engine failed: {exc}", type_="server_error")
            if r.status_code != 200 and release is not None:
                await release()  # refused before it took the lease: give it back
            return _json_or_raw(r)
        seed_chunks = _seed_chunks(first, body) if first is not None else []

        async def stream() -> AsyncIterator[bytes]:
            sent = False
            async with self._outstanding(up):
                try:
                    for c in seed_chunks:
                        yield _sse(c)
                    r = await client.send(req, stream=True)
                    sent = True
                except httpx.HTTPError as exc:
                    yield _sse(
                        {
                            "error": {
                                "message": f"the decode engine failed: {exc}",
                                "type": "server_error",
                                "param": None,
                                "code": None,
                            }
                        }
                    )
                    return
                finally:
                    if not sent and release is not None:
                        # The decode engine never got the lease: give it back now. A
                        # task, since the client may be gone and this frame cancelled.
                        self._background(release())
                try:
                    if r.status_code != 200:
                        if release is not None:
                            self._background(release())
                        raw = await r.aread()
                        try:
                            yield _sse(json.loads(raw))
                        except ValueError:
                            yield _sse({"error": {"message": raw.decode(errors="replace"),
                                                  "type": "server_error", "param": None,
                                                  "code": None}})
                        return
                    async for line in r.aiter_lines():
                        if line:
                            yield (line + "\n\n").encode()
                finally:
                    await r.aclose()

        return StreamingResponse(stream(), media_type="text/event-stream")


class _Disconnected(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[httpx.Response]) -> httpx.Response:
    """Await ``work``; if the client goes away first, cancel it (closing the upstream
    connection, which the engine turns into an abort) and raise ``_Disconnected``."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _Disconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _json_or_raw(r: httpx.Response) -> Response:
    try:
        return JSONResponse(r.json(), status_code=r.status_code)
    except ValueError:
        return Response(r.content, status_code=r.status_code)


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _text_of(choice: dict[str, Any]) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    return choice.get("text") or ""


def _set_text(choice: dict[str, Any], text: str) -> None:
    if "message" in choice:
        choice["message"]["content"] = text
    else:
        choice["text"] = text


def _seed_chunks(first: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's opening chunk(s) carrying the prefill engine's first token."""
    text = _text_of(first["choices"][0])
    base = {
        "id": first.get("id", f"cmpl-{uuid.uuid4().hex}"),
        "created": first.get("created"),
        "model": first.get("model"),
    }
    if first.get("object") == "chat.completion":
        delta = {"role": "assistant", "content": text}
        return [
            dict(
                base,
                object="chat.completion.chunk",
                choices=[{"index": 0, "delta": delta, "finish_reason": None}],
            )
        ]
    return [
        dict(
            base,
            object="text_completion",
            choices=[{"index": 0, "text": text, "finish_reason": None}],
        )
    ]


def _chunks_from_full(full: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole answer (finished at the prefill engine) as stream chunks."""
    chunks = _seed_chunks(full, body)
    finish = full["choices"][0].get("finish_reason")
    chunks[-1]["choices"][0]["finish_reason"] = finish
    include_usage = (body.get("stream_options") or {}).get("include_usage")
    if include_usage and full.get("usage"):
        chunks.append(dict(chunks[0], choices=[], usage=full["usage"]))
    return chunks


def create_proxy_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        proxy.client = httpx.AsyncClient(limits=limits)
        health = asyncio.create_task(proxy.health_loop())
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await proxy.client.aclose()

    app = FastAPI(title="kvrelay proxy", lifespan=lifespan)

    def authorized(request: Request) -> bool:
        if proxy.api_key is None:
            return True
        return request.headers.get("authorization") == f"Bearer {proxy.api_key}"

    @app.get("/health")
    async def health() -> Response:
        ok = proxy.decode.pick() is not None
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorized(request):
            return error_body(401, "missing or wrong API key", type_="authentication_error")
        up = proxy.decode.candidates()[0]
        r = await proxy._http().get(f"{up.url}/v1/models", headers=proxy._headers())
        return _json_or_raw(r)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if not authorized(request):
            return error_body(401, "missing or wrong API key", type_="authentication_error")
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        if not authorized(request):
            return error_body(401, "missing or wrong API key", type_="authentication_error")
        return await proxy.handle(request, "/v1/chat/completions")

    return app


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "proxy", help="an OpenAI-compatible front for prefill and decode engines",
        description="Route each request through a prefill engine and a decode engine "
        "(least outstanding requests among the healthy), seeding the first token.",
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill engines (kvrelay serve --role prefill), e.g. http://h:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode engines (kvrelay serve --role decode)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require and forward 'Authorization: Bearer KEY'")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often each engine's /health is checked")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: Any) -> int:
    import uvicorn

    from kvrelay.server.graceful import GracefulServer

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(args.prefill, args.decode, api_key=args.api_key,
                  health_interval=args.health_interval)
    log.info("proxy on http://%s:%d/v1: prefill %s, decode %s", args.host, args.port,
             " ".join(args.prefill), " ".join(args.decode))
    config = uvicorn.Config(create_proxy_app(proxy), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=args.log_level == "debug")
    server = GracefulServer(config, drain=lambda: None, drain_after=10.0)
    server.run()
    return 0 if server.started else 1
