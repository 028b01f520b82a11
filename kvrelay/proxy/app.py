"""The disaggregation proxy: one OpenAI-compatible front for prefill and decode engines.

Per request (DESIGN section 1):
1. validate the body as an engine would (the same 400s, before any engine is asked),
   and split it into legs: one per prompt of a batch and per choice (``n``), each a
   one-prompt ``n=1`` request (kvrelay.proxy.merge);
2. per leg, pick a prefill engine and a decode engine among the healthy ones: by default
   the one that most likely holds the prompt's prefix in its cache, unless it is too busy,
   else the one with the fewest outstanding requests (kvrelay.proxy.affinity);
   send the prefill engine the leg with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params: {"do_remote_decode": true}``; it answers with the first token
   and the lease (``kv_transfer_params``). Every leg's prefill runs at
   once; the client leaving meanwhile cancels them (P aborts the prefill);
3. stream each first token to the client at once (first-token seeding: the time to
   first token is the prefill's, not prefill + transfer + decode);
4. send the decode engine the leg plus the lease, marked ``first_token_sent`` (so it
   does not send token 1 again); it pulls the KV and streams tokens 2..n (a tool leg's
   answer is D's whole, token 1 included: ``Leg.tools``);
5. merge the legs into one answer: one id, each choice under its index, one role per
   chat choice, logprobs covering every token, usage counting each prompt once.

A prefill engine that fails is retried on another; with none left the leg goes to a
decode engine as plain colocated work. A lease the decode engine never got (the client
left, the decode engine refused or failed) is given back on the prefill engine
(``POST /v1/kv/release``); once D has it, D releases it itself. Every error is an
OpenAI error body; an engine that fails mid-stream ends the stream with an error event
and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.proxy import sockets
from kvrelay.proxy.affinity import POLICIES, RoutingConfig
from kvrelay.proxy.discovery import add_discovery_args, discovery_from
from kvrelay.proxy.health import watch_health
from kvrelay.proxy.placement import add_placement_args, placement_from
from kvrelay.proxy.responses import RESPONSES_PATH, ResponseRouter
from kvrelay.proxy.routing import CHAT_PATH, COMPLETIONS_PATH, Proxy
from kvrelay.proxy.upstreams import json_or_error
from kvrelay.wire.http import ApiError, install_error_handlers, read_body

__all__ = ["Proxy", "create_proxy_app", "register", "run"]

log = logging.getLogger(__name__)


class SweptTransport(httpx.AsyncHTTPTransport):
    """httpx's pool, with the connections cancelled calls strand closed.

    httpcore 1.0 shields its clean-ups from anyio's cancellation, not from asyncio's
    ``Task.cancel()``, which the proxy uses whenever a client leaves. Two ways a cancel
    strands a connection, each one fd (and one request slot on the engine) for ever:

    - a request cancelled after its connection was made but before it took the
      connection's state lock leaves that connection NEW in the pool, where nothing ever
      uses, expires or closes it (encode/httpcore#1093 and kin; the soak: 14 -> 29 fds in
      593 s, each a socket to D both ends kept open). A connection in use always belongs
      to a request the pool still queues; any other that is neither idle nor closed is an
      orphan: after every call that ends by an exception, orphans are taken out of the
      pool and closed (``sweep``);
    - a response whose close is cancelled at one of its awaits (the connection's state
      lock, the socket's close) stays ACTIVE with its request queued in the pool for
      ever: a leg task cancelled (its client left) just as it closes D's finished stream.
      Once the engine times the idle connection out, the proxy's socket sits in
      CLOSE_WAIT (the soak: 1 -> 10 in 30 minutes). Every response's close runs to its
      end in a task of its own (``_FinishedBody``); one that a cancel cut inside a read
      (closed, its request still queued) is finished there (``finish``).

    Closes run in the background: the caller may be cancelled."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # httpx takes no network backend: the pool's own, swapped before any connection.
        backend = sockets.backend()
        if backend is not None and hasattr(self._pool, "_network_backend"):
            self._pool._network_backend = backend
        self._closing: set[asyncio.Future[None]] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except BaseException:
            self.sweep()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _FinishedBody(response.stream, self)
        return response

    def sweep(self) -> int:
        """Take the orphans out of the pool and close them; how many."""
        pool = self._pool
        with pool._optional_thread_lock:
            used = {id(r.connection) for r in pool._requests if r.connection is not None}
            orphans = [c for c in pool._connections
                       if id(c) not in used and not c.is_idle() and not c.is_closed()]
            for c in orphans:
                pool._connections.remove(c)
        self._close_later(orphans)
        if orphans:
            log.debug("closed %d stranded upstream connections", len(orphans))
        return len(orphans)

    def finish(self, body: httpx.AsyncByteStream) -> bool:
        """After ``body``'s close: if a cancel cut it short (its request still queued, or
        its connection neither idle, closed nor another request's), take both out of the
        pool and close the connection. Whether it did."""
        stream = getattr(body, "_httpcore_stream", None)  # httpcore's PoolByteStream
        pool_request = getattr(stream, "_pool_request", None)
        if pool_request is None or not getattr(stream, "_closed", False):
            return False
        pool, conn = self._pool, pool_request.connection
        with pool._optional_thread_lock:
            queued = pool_request in pool._requests
            if queued:
                pool._requests.remove(pool_request)
            stranded = conn is not None and not (
                conn.is_idle() or conn.is_closed()
                or any(r.connection is conn for r in pool._requests))
            if stranded and conn in pool._connections:
                pool._connections.remove(conn)
            if not (queued or stranded):
                return False
            closing = pool._assign_requests_to_connections()
        self._close_later([conn, *closing] if stranded else closing)
        log.debug("finished the close of an upstream response that a cancel cut short")
        return True

    def _close_later(self, connections: list[Any]) -> None:
        for c in connections:
            self.in_background(c.aclose())

    def in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """``work`` as a task held until it ends."""
        task = asyncio.ensure_future(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task


class _FinishedBody(httpx.AsyncByteStream):
    """A response body whose close runs to its end in a task of its own: a cancel of the
    caller (the client left) no longer cuts it short, and what an earlier cut left
    (a read's close cancelled) is finished (``SweptTransport.finish``). One task reads a
    body and closes it, as httpx's ``stream()`` and ``send()`` do."""

    def __init__(self, body: httpx.AsyncByteStream, transport: SweptTransport) -> None:
        self._body, self._transport = body, transport
        self._closed: asyncio.Future[None] | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._body:
            yield part

    async def aclose(self) -> None:
        if self._closed is None:
            self._closed = self._transport.in_background(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        try:
            await self._body.aclose()
        finally:
            self._transport.finish(self._body)


def create_proxy_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        proxy.client = httpx.AsyncClient(transport=SweptTransport(limits=limits))
        health = asyncio.create_task(watch_health(
            proxy.prefill, proxy.decode, proxy.client, proxy.headers(), proxy.metrics,
            interval=proxy.health_interval, discovery=proxy.discovery,
            kv_events=proxy.kv_events))
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await proxy.client.aclose()
            if proxy.kv_events is not None:
                proxy.kv_events.close()

    app = FastAPI(title="kvrelay proxy", lifespan=lifespan)
    install_error_handlers(app)

    def check_auth(request: Request) -> None:
        if proxy.api_key is None:
            return
        if request.headers.get("authorization") != f"Bearer {proxy.api_key}":
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           param="Authorization", code="invalid_api_key",
                           type="authentication_error")

    @app.get("/health")
    async def health() -> Response:
        ok = proxy.decode.pick() is not None
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def any_engine(method: str, path: str, body: bytes | None = None) -> Response:
        """The answer of the first healthy engine (decode ones first) that gives one
        under 500: requests every engine answers alike (the model, its tokenizer)."""
        failures = []
        for up in proxy.decode.candidates() + proxy.prefill.candidates():
            try:
                r = await proxy._http().request(
                    method, f"{up.url}{path}", content=body, timeout=10.0,
                    headers={**proxy.headers(), "content-type": "application/json"})
            except httpx.HTTPError as exc:
                failures.append(f"{up.url}: {type(exc).__name__}")
                continue
            if r.status_code < 500:
                return json_or_error(r)
            failures.append(f"{up.url}: HTTP {r.status_code}")
        raise ApiError(503, "no engine answered: " + "; ".join(failures), type="server_error",
                       code="unavailable")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return await any_engine("GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_auth(request)
        return await any_engine("POST", "/tokenize", await read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_auth(request)
        return await any_engine("POST", "/detokenize", await read_body(request))

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        check_auth(request)
        return await proxy.handle(request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        check_auth(request)
        return await proxy.handle(request, CHAT_PATH)

    responses = ResponseRouter(proxy)

    @app.post(RESPONSES_PATH)
    async def create_response(request: Request) -> Response:
        check_auth(request)
        return await responses.handle(request)

    return app


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "proxy", help="an OpenAI-compatible front for prefill and decode engines",
        description="Route each request through a prefill engine and a decode engine "
        "(by expected prefix-cache reuse and load among the healthy), seeding the first "
        "token.",
    )
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill engines (kvrelay serve --role prefill), e.g. http://h:8100 "
                   "(this or --prefill-dns is required)")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL",
                   help="decode engines (kvrelay serve --role decode) (this or --decode-dns "
                   "is required)")
    add_discovery_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require and forward 'Authorization: Bearer KEY'")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often each engine's /health is checked")
    p.add_argument("--upstream-read-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="the longest the proxy waits on a prefill or decode engine per "
                   "phase of a call (connect, each write, each read): a call past it fails "
                   "as that engine's failure")
    d = RoutingConfig()
    p.add_argument("--routing", choices=POLICIES, default=d.policy,
                   help="kv-aware: the engine holding the longest prefix of the prompt, "
                   "within the balance threshold, else the least loaded; least-outstanding: "
                   "always the least loaded")
    p.add_argument("--routing-cache-threshold", type=float, default=d.cache_threshold,
                   metavar="FRACTION", help="kv-aware: route by prefix only when the match "
                   "covers at least this fraction of the prompt's text")
    p.add_argument("--routing-balance-abs-threshold", type=int,
                   default=d.balance_abs_threshold, metavar="N",
                   help="kv-aware: route by prefix only while that engine has at most N "
                   "more outstanding requests than the least loaded")
    p.add_argument("--routing-chunk-chars", type=int, default=d.chunk_chars, metavar="N",
                   help="kv-aware: characters of prompt text per recorded chunk")
    p.add_argument("--routing-cache-size", type=int, default=d.cache_size, metavar="CHUNKS",
                   help="kv-aware: chunks remembered per engine (LRU)")
    p.add_argument("--kv-events", action="store_true",
                   help="kv-aware: know each engine's cache from its KV events (engines "
                   "started with --kv-events-config; the endpoint read from their GET "
                   "/v1/kv/events) instead of guessing it from the prompts sent")
    add_placement_args(p)
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def routing_config(args: Any) -> RoutingConfig:
    from kvrelay.errors import UsageError

    try:
        return RoutingConfig(
            policy=args.routing, chunk_chars=args.routing_chunk_chars,
            cache_threshold=args.routing_cache_threshold,
            balance_abs_threshold=args.routing_balance_abs_threshold,
            cache_size=args.routing_cache_size, kv_events=args.kv_events)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def run(args: Any) -> int:
    import uvicorn

    from kvrelay.errors import UsageError
    from kvrelay.wire.graceful import GracefulServer

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        # httpx logs every request at info: with health polling, most of the log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    routing = routing_config(args)
    if args.upstream_read_timeout <= 0:
        raise UsageError(f"--upstream-read-timeout {args.upstream_read_timeout:g}: must be > 0")
    proxy = Proxy(args.prefill, args.decode, api_key=args.api_key,
                  health_interval=args.health_interval, timeout=args.upstream_read_timeout,
                  routing=routing, discovery=discovery_from(args),
                  placement=placement_from(args))
    log.info("proxy on http://%s:%d/v1: prefill %s, decode %s; routing %s; %s", args.host,
             args.port, " ".join(args.prefill), " ".join(args.decode), routing,
             proxy.placement)
    config = uvicorn.Config(create_proxy_app(proxy), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=args.log_level == "debug")
    server = GracefulServer(config, drain=lambda: None, drain_after=10.0)
    server.run()
    return 0 if server.started else 1
