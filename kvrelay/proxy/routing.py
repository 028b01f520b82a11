"""The proxy's routing: upstream engines, legs through P and D, streams (see
kvrelay.proxy.app for the flow, kvrelay.proxy.merge for the merging)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvrelay.proxy import merge
from kvrelay.proxy.affinity import (
    RoutingConfig,
    chain_hashes,
    chat_text,
    completion_text,
)
from kvrelay.proxy.discovery import Discovery
from kvrelay.proxy.events import EventMetrics, KvEventsFeed, tokenize_on
from kvrelay.proxy.legs import Leg, LegEvent
from kvrelay.proxy.merge import Frame
from kvrelay.proxy.metrics import ProxyMetrics
from kvrelay.proxy.placement import CHARS_PER_TOKEN, PlacementConfig, Work, local_reason
from kvrelay.proxy.upstreams import (
    _CLOSED,
    Refused,
    Upstream,
    UpstreamDown,
    Upstreams,
    _error,
    _json_body,
    _Unseen,
)
from kvrelay.wire.http import error_event, load_json, read_body, sse, validate
from kvrelay.wire.openai import ChatCompletionRequest, CompletionRequest
from kvrelay.wire.sse import EventStream, until_disconnect

log = logging.getLogger(__name__)
T = TypeVar("T")

RELEASE_PATH = "/v1/kv/release"  # on the prefill engine
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
NO_DECODE_ENGINE = "no decode engine is known: its DNS names resolve to no address"


class Piece(enum.Enum):
    """What a streamed leg puts on the request's queue of events."""

    P_TOKEN = "p_token"  # P's first token, as a chunk choice
    D_TOKENS = "d_tokens"  # a chunk choice of D's after P's token
    WHOLE = "whole"  # a chunk choice of D serving the whole choice (colocated, tools)
    END = "end"  # the leg's answer is complete
    ERROR = "error"  # the leg failed: its error event ends the client's stream


class Proxy:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        *,
        api_key: str | None = None,
        health_interval: float = 2.0,
        timeout: float = 600.0,
        routing: RoutingConfig | None = None,
        discovery: Discovery | None = None,
        placement: PlacementConfig | None = None,
    ) -> None:
        self.routing = routing or RoutingConfig()
        self.placement = placement or PlacementConfig()
        named = discovery.names if discovery is not None else {}
        self.prefill = Upstreams("prefill", prefill, self.routing,
                                 discovered=bool(named.get("prefill")))
        self.decode = Upstreams("decode", decode, self.routing,
                                discovered=bool(named.get("decode")))
        self.discovery = discovery  # engines found by DNS names
        self.api_key = api_key
        self.health_interval = health_interval
        self.timeout = timeout
        self.metrics = ProxyMetrics()
        events = EventMetrics(self.metrics.registry)  # exported with or without --kv-events
        self.kv_events = (KvEventsFeed(events, self.routing.chunk_chars)
                          if self.routing.kv_events else None)
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

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @contextlib.asynccontextmanager
    async def _outstanding(self, up: Upstream) -> AsyncIterator[None]:
        up.outstanding += 1
        self.metrics.outstanding.labels(up.role, up.url).set(up.outstanding)
        try:
            yield
        finally:
            up.outstanding -= 1
            self.metrics.outstanding.labels(up.role, up.url).set(up.outstanding)

    async def _unless_gone(self, request: Request, work: Coroutine[Any, Any, T]) -> T | None:
        """``work``, or None (``work`` cancelled) when the client goes away first."""
        result = await until_disconnect(request, work)
        if result is None:
            self.metrics.client_disconnects.inc()
        return result

    # -- the request path ----------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        data = load_json(await read_body(request))
        chat = path == CHAT_PATH
        req: ChatCompletionRequest | CompletionRequest = (
            validate(data, ChatCompletionRequest) if chat else validate(data, CompletionRequest))
        req.check()
        frame = Frame(chat, include_usage=req.include_usage_in_stream())
        legs = _split(data, req, chat)
        self._route_keys(legs, req, chat)
        if self.kv_events is not None:
            await self.kv_events.route_keys(legs, chat, self._tokenize)
        t0 = asyncio.get_running_loop().time()
        streaming = False
        # Prompt logprobs and echo are P's: it computes every prompt position (see
        # _prefill). Tool calls are read out of the whole output: D serves such a leg
        # whole, token 1 (P's) included (see Leg.tools). A leg placed on D
        # (conditional disaggregation) is D's alone, as colocated work.
        whole = self._tool_legs(req, legs)
        to_prefill = [] if whole else [leg for leg in legs if self._to_prefill(leg)]
        for leg in legs:
            if leg not in to_prefill:
                leg.served_whole()
        if whole:
            self.metrics.requests.labels("colocated").inc(len(legs))
        try:
            if await self._unless_gone(request, _all(
                    self._prefill_leg(path, leg) for leg in to_prefill)) is None:
                return Response(status_code=499)  # P's requests were cancelled: P aborts
            if req.stream:
                streaming = True  # from here the stream gives back what D never got
                return EventStream(self._stream(path, legs, frame, t0),
                                   on_close=lambda: self._release_all(legs))
            choices = await self._unless_gone(request, _all(
                self._decode_leg(path, leg, frame) for leg in legs))
            if choices is None:
                return Response(status_code=499)
        except Refused as exc:
            return exc.response
        finally:
            if not streaming:
                self._release_all(legs)
        frame.model = frame.model or req.model
        self.metrics.ttft.observe(asyncio.get_running_loop().time() - t0)
        return JSONResponse(merge.full_body(frame, legs, choices))

    @staticmethod
    def _tool_legs(req: Any, legs: list[Leg]) -> bool:
        """Mark the legs of a request whose answer is read for tool calls; True when they
        go whole to a decode engine: with logprobs (D has none for token 1: P computed
        its logits) or one token (P's alone, its answer not parsed as D's would be)."""
        if not isinstance(req, ChatCompletionRequest) or not req.parses_tools():
            return False
        assert req.tool_plan is not None
        for leg in legs:
            leg.tools = req.tool_plan.mode
        return req.logprobs or req.requested_max_tokens() == 1

    def _route_keys(self, legs: list[Leg], req: Any, chat: bool) -> None:
        """Each leg's prompt length (conditional disaggregation) and, with KV-aware
        routing by guesses, its hash chain (with --kv-events the chain is of tokens:
        KvEventsFeed.route_keys)."""
        chunk = self.routing.chunk_chars
        kv_aware = self.routing.kv_aware and self.kv_events is None
        text = chat_text(req.template_messages()) if chat else ""
        chain = chain_hashes(text, chunk) if chat and kv_aware else []
        tokens = len(text) / CHARS_PER_TOKEN
        for leg in legs:
            if not chat and leg.counts_prompt:  # a completion prompt's first choice
                prompt = leg.body["prompt"]
                text = completion_text(prompt)
                chain = chain_hashes(text, chunk) if kv_aware else []
                tokens = len(prompt) if isinstance(prompt, list) else len(text) / CHARS_PER_TOKEN
            leg.chain, leg.text_len, leg.tokens = chain, len(text), tokens

    async def _tokenize(self, body: dict[str, Any]) -> list[int] | None:
        urls = [u.url for u in self.decode.candidates() + self.prefill.candidates()]
        return await tokenize_on(self._http(), urls, self.headers(), body)

    def _pick(self, ups: Upstreams, leg: Leg) -> Upstream:
        """The routed engine, counted."""
        up, reason = ups.route(leg)
        self.metrics.route.labels(ups.role, reason.value).inc()
        log.debug("route %s %s: %s (outstanding %d)", ups.role, up.url, reason.value,
                  up.outstanding)
        return up

    def _to_prefill(self, leg: Leg) -> bool:
        """Conditional disaggregation (proxy_placement): False when the leg is to be
        prefilled by the decode engine it is routed to now (``leg.decoder``), counted
        under role prefill with the reason."""
        if self.placement.mode == "always" or not self.decode.all:
            return True
        d = leg.decoder = self._pick(self.decode, leg)
        # What D holds, not what was sent to it (Upstream.landed): a prefix on its way
        # from P is not there yet. P's record is what was sent: a prefix in flight on P
        # lands with the step computing it, before the step a later prompt joins.
        leg.local_tokens = self._uncached(leg, d.landed.match(leg.chain) if d.landed else 0)
        # Per healthy P: its work in flight with this prompt's, and this prompt's.
        remote = min(((max(0.0, up.prefilling) + t, t) for up in self.prefill.all if up.healthy
                      for t in (self._uncached(leg, up.prefixes.match(leg.chain)),)),
                     default=None)
        why = local_reason(self.placement, Work(leg.tokens, leg.local_tokens,
                                                max(0.0, d.prefilling), remote and remote[0]))
        if why is None:
            leg.remote_tokens = remote[1] if remote else None
            return True
        self.metrics.route.labels("prefill", why.value).inc()
        self.metrics.requests.labels("local_prefill").inc()
        log.debug("prefill on decode engine %s: %s", leg.decoder.url, why.value)
        return False

    def _uncached(self, leg: Leg, matched: int) -> float:
        """The leg's prompt tokens an engine would compute, ``matched`` chunks of its chain
        being in the engine's cache."""
        if not leg.text_len:
            return leg.tokens
        return leg.tokens * (1.0 - min(1.0, matched * self.routing.chunk_chars / leg.text_len))

    def _prefill_order(self, leg: Leg) -> list[Upstream]:
        """The routed prefill engine, then the others to retry on, least loaded first."""
        if not self.prefill.all:  # DNS names that resolve to nothing (now)
            return []
        first = self._pick(self.prefill, leg)
        return [first, *(up for up in self.prefill.candidates() if up is not first)]

    def _decode_order(self, leg: Leg) -> list[Upstream]:
        """The routed decode engine, then the others, least loaded first: an engine that
        refuses a leg unseen (503: draining, or its loop down; connection refused; a
        stream's connection closed before its status line) hands it to the next, the
        lease untouched."""
        if not self.decode.all:  # DNS names that resolve to nothing (now)
            return []
        # Routed already when the leg was placed (and still known), else now.
        first = leg.decoder if leg.decoder in self.decode.all else self._pick(self.decode, leg)
        return [first, *(up for up in self.decode.candidates() if up is not first)]

    def _refused_unseen(self, up: Upstream, why: str, busy: bool = False) -> None:
        if not busy:
            up.healthy = False  # until its next health check says otherwise
        log.info("decode engine %s refused a leg unseen (%s): trying the next", up.url, why)

    def _release_all(self, legs: list[Leg]) -> None:
        """The request is over: every lease still the proxy's (D never got it) back to
        its prefill engine, and every leg done."""
        for leg in legs:
            self._give_back(leg, leg.finished())

    def _release(self, leg: Leg) -> None:
        """A lease the proxy still holds, back to P (D never got it)."""
        self._give_back(leg, leg.take_lease())

    def _give_back(self, leg: Leg, params: dict[str, Any] | None) -> None:
        if params is not None and leg.prefill_url is not None:
            self._background(self._post_release(leg.prefill_url, params))

    async def _post_release(self, prefill_url: str, params: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http().post(
                f"{prefill_url}{RELEASE_PATH}", json={"kv_transfer_params": params},
                headers=self.headers(), timeout=5.0,
            )

    # -- prefill -----------------------------------------------------------------------
    async def _prefill_leg(self, path: str, leg: Leg) -> None:
        leg.on(LegEvent.PREFILL)
        for attempt, up in enumerate(self._prefill_order(leg)):
            try:
                with _Prefilling(up, leg.tokens if leg.remote_tokens is None
                                 else leg.remote_tokens):
                    first = await self._prefill(up, path, leg.p_body())
            except UpstreamDown as exc:
                self.metrics.prefill_failures.inc()
                up.healthy = False
                log.warning("prefill engine %s failed (attempt %d): %s", up.url, attempt + 1, exc)
                continue
            up.healthy = True
            unneeded = leg.prefilled(first, up.url)
            if unneeded is not None:  # e.g. max_tokens 1: the lease is not needed
                self._background(self._post_release(up.url, unneeded))
            if leg.ended_at_prefill and leg.tools is not None:
                # Token 1 ended it (EOS): D serves the leg whole, so that its answer is
                # read for calls as a colocated one is.
                leg.served_whole()
                self.metrics.requests.labels("colocated").inc()
                return
            self.metrics.requests.labels("disaggregated").inc()
            return
        self.metrics.requests.labels("prefill_unavailable").inc()
        leg.served_whole()  # D prefills it too

    async def _prefill(self, up: Upstream, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """P's answer: token 1 and the lease. With echo or prompt_logprobs it also holds
        the prompt (its text and logprobs, which P computes: it ran every position);
        echo with max_tokens 0 is P's alone, no lease."""
        if body.get("echo") and body.get("max_tokens") == 0:
            p_body = dict(body, stream=False)
        else:
            # The key names the lease before it exists: a call that ends without an answer
            # read here (the client left as P wrote it, P failed mid-answer) gives back by
            # it whatever lease P made, at once (kvrelay.relay.release_keys).
            key = secrets.token_urlsafe(16)
            p_body = dict(body, max_tokens=1, stream=False,
                          kv_transfer_params={"do_remote_decode": True, "release_key": key})
            if body.get("max_completion_tokens", body.get("max_tokens")) == 1:
                # P's answer is the whole choice: asked as plain work, no lease, and its
                # text ends as a colocated engine's would (a handed-off answer holds back a
                # partial character for D, which never comes: the soak saw '' for it).
                del p_body["kv_transfer_params"]
        if body.get("stream"):
            p_body.pop("prompt_logprobs", None)  # a stream does not show them
        p_body.pop("stream_options", None)
        p_body.pop("max_completion_tokens", None)
        if "min_tokens" in p_body:  # P samples token 1: min_tokens >= 1 masks its EOS there
            p_body["min_tokens"] = min(p_body["min_tokens"], 1)
        read = "kv_transfer_params" not in p_body  # True: no lease to give back by key
        try:
            async with self._outstanding(up):
                try:
                    r = await self._http().post(up.endpoint(path), json=p_body,
                                                headers=self.headers(), timeout=self.timeout)
                except httpx.HTTPError as exc:
                    raise UpstreamDown(f"{type(exc).__name__}: {exc}") from exc
            if r.status_code >= 500:
                raise UpstreamDown(f"HTTP {r.status_code}: {r.text[:200]}")
            if r.status_code != 200:
                read = True  # refused: no lease was made
                raise Refused(r)
            try:
                first = r.json()
                first["choices"][0]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise UpstreamDown(f"not an OpenAI answer: {r.text[:200]}") from exc
            read = True
            return dict(first)
        finally:
            if not read:
                self._background(self._post_release(up.url, {"release_key": key}))

    def _decode_body(self, leg: Leg, stream: bool) -> dict[str, Any]:
        body = dict(leg.body, stream=stream)
        if leg.first is not None:  # P's answer holds the prompt's echo and logprobs
            if not leg.resends:  # a D that resends answers the whole choice: its echo too
                body.pop("echo", None)
            body.pop("prompt_logprobs", None)
        if stream:
            body["stream_options"] = {"include_usage": True}  # the proxy sums usage
        if leg.owns_lease():
            assert leg.params is not None
            # The client has token 1 from P already: D must not send it again (a vLLM
            # decode engine does: its answer is cut instead, see Leg.resends). A tool
            # leg's answer is D's whole: D sends token 1 itself.
            sent = not (leg.resends or leg.tools is not None)
            body["kv_transfer_params"] = dict(leg.params, first_token_sent=True) if sent \
                else dict(leg.params)
        return body

    # -- whole answers ---------------------------------------------------------------
    async def _decode_leg(self, path: str, leg: Leg, frame: Frame) -> dict[str, Any]:
        frame.saw(leg.first or {})
        if leg.ended_at_prefill:
            return merge.leg_choice(leg, None)
        try:
            decoded = await self._decode(path, leg, frame, None)
        except _LegFailed as exc:
            self._release(leg)  # D never had it (its 200 makes it D's)
            raise Refused(exc.response) from None
        assert decoded is not None
        return merge.leg_choice(leg, decoded)

    # -- streams -----------------------------------------------------------------------
    async def _stream(
        self, path: str, legs: list[Leg], frame: Frame, t0: float
    ) -> AsyncIterator[bytes]:
        events: asyncio.Queue[tuple[Leg, Piece, Any]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._stream_leg(path, leg, frame, events))
                 for leg in legs]
        first_out = False
        # The events of what the legs had queued go out as one write: D's stream arrives
        # a read of many chunks at a time, and a write per chunk cost more than the rest
        # of its way through the proxy (kvrelay bench front). The bytes are the same.
        out: list[bytes] = []
        try:
            open_legs = len(legs)
            while open_legs:
                if out and events.empty():
                    yield b"".join(out)
                    out = []
                leg, kind, payload = await events.get()
                if kind is Piece.ERROR:
                    out.append(sse(payload))
                    yield b"".join(out)
                    break
                try:
                    if kind is Piece.END:
                        merge.check_resent(leg)
                        open_legs -= 1
                        continue
                    if kind is Piece.D_TOKENS and leg.resends:
                        payload = merge.cut_resent(leg, payload)
                except merge.Spliced as exc:
                    log.warning("leg %d: %s", leg.index, exc)
                    out.append(sse(error_event(str(exc))))
                    yield b"".join(out)
                    break
                if payload is not None:
                    # D's text offsets count from token 2, unless D sent token 1 again.
                    shift = leg.shift if kind is Piece.D_TOKENS and not leg.resends else 0
                    for chunk in merge.reframe(frame, leg, payload, shift):
                        if not first_out:
                            first_out = True
                            self.metrics.ttft.observe(asyncio.get_running_loop().time() - t0)
                        out.append(sse(chunk))
            else:
                if frame.include_usage:
                    out.append(sse(merge.usage_chunk(frame, legs)))
                if out:
                    yield b"".join(out)
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.client_disconnects.inc()
            raise
        finally:
            for t in tasks:
                t.cancel()
            self._release_all(legs)
        yield sse("[DONE]")

    async def _stream_leg(
        self, path: str, leg: Leg, frame: Frame, events: asyncio.Queue[tuple[Leg, Piece, Any]]
    ) -> None:
        """Put the leg's chunk choices on ``events`` (P's token, D's), then END, or one
        ERROR event."""
        ended = False  # D's [DONE] came: END is on ``events``
        try:
            if leg.first is not None and leg.tools is None:  # a tool leg's chunks are D's
                frame.saw(leg.first)
                if leg.ended_at_prefill:  # P's token is the whole choice
                    events.put_nowait((leg, Piece.P_TOKEN, merge.seed_chunk(leg)))
                    leg.usage = leg.first.get("usage")
                    events.put_nowait((leg, Piece.END, None))
                    return
                if leg.streams_first_token():
                    events.put_nowait((leg, Piece.P_TOKEN, merge.seed_chunk(leg)))
            kind = Piece.D_TOKENS if leg.first is not None and leg.tools is None else Piece.WHOLE
            error = None

            def to_client(choice: Any) -> None:
                nonlocal ended
                if choice is None:  # D's [DONE]: the leg's END, before D's body is read out
                    ended = True
                    events.put_nowait((leg, Piece.END, None))
                else:
                    events.put_nowait((leg, kind, choice))

            try:
                await self._decode(path, leg, frame, to_client)
            except _LegFailed as exc:
                error = _json_body(exc.response)
        except Exception as exc:  # never leave the client's stream waiting
            log.exception("leg %d failed", leg.index)
            error = error_event(f"the proxy failed: {type(exc).__name__}: {exc}", 500)
        if ended:
            return  # the answer was whole at D's [DONE]: what failed after it is not the leg's
        if error is not None:
            self._release(leg)
            events.put_nowait((leg, Piece.ERROR, error))
        else:
            events.put_nowait((leg, Piece.END, None))

    # -- one decode attempt, whole or streamed ------------------------------------------
    async def _decode(
        self, path: str, leg: Leg, frame: Frame, stream_to: Callable[[Any], None] | None,
    ) -> dict[str, Any] | None:
        """D's answer for the leg: its JSON (whole), or each chunk choice to
        ``stream_to`` and None at its end (streamed, returns None); ``_LegFailed`` with the
        client's error
        otherwise. An engine that refuses the leg unseen (connection refused, closed
        before its status line, 429, 503) hands it to the next (``_decode_order``),
        the lease untouched: the same rule for whole and streamed answers."""
        body = self._decode_body(leg, stream=stream_to is not None)
        # Built only when every engine refused: an httpx.Response costs ~40 us, about 1%
        # of the proxy's CPU per request (kvrelay bench front).
        failure: httpx.Response | None = None
        closed: str | None = None  # an engine closed the connection before answering
        for up in self._decode_order(leg):
            try:
                return await self._decode_on(up, path, leg, frame, body, stream_to, closed)
            except _Unseen as exc:
                self._refused_unseen(up, exc.why, busy=exc.busy)
                failure, closed = exc.response, exc.closed or closed
        raise _LegFailed(failure if failure is not None else _error(503, NO_DECODE_ENGINE))

    async def _decode_on(
        self, up: Upstream, path: str, leg: Leg, frame: Frame, body: dict[str, Any],
        stream_to: Callable[[Any], None] | None, closed: str | None,
    ) -> dict[str, Any] | None:
        """One engine's answer (see ``_decode``). ``closed``: an earlier engine's close
        under this leg (see _lease_lost)."""
        answered = False
        async with self._outstanding(up):
            with _Prefilling(up, _local_work(leg)) as work:
                try:
                    async with self._http().stream("POST", up.endpoint(path), json=body,
                                                   headers=self.headers(),
                                                   timeout=self.timeout) as r:
                        answered = True
                        if r.status_code != 200:
                            await r.aread()
                            if r.status_code in (429, 503):  # draining, or its queue full
                                raise _Unseen(r, f"HTTP {r.status_code}",
                                              busy=r.status_code == 429)
                            lost = _lease_lost(closed, r.status_code, _json_body(r))
                            raise _LegFailed(r if lost is None else _error(502, lost))
                        leg.handed()  # D has the lease: it pulls or gives it back
                        if stream_to is None:
                            await r.aread()
                            decoded: dict[str, Any] = r.json()
                            _landed(up, leg)
                            frame.saw(decoded)
                            return decoded
                        await _read_stream(r, up, leg, frame, work, stream_to)
                        return None
                except httpx.ConnectError as exc:  # D never saw the leg: the next one
                    raise _Unseen(_error(502, f"the decode engine {up.url} is unreachable: "
                                              f"{exc}"), f"{type(exc).__name__}: {exc}") from exc
                except httpx.HTTPError as exc:
                    if not answered and isinstance(exc, _CLOSED):
                        # Closed before its status line: a pooled connection the engine
                        # closed idle as the leg was sent (a drained engine's shutdown, its
                        # keep-alive timeout), the leg unread; uvicorn answers what it has
                        # read (503 while draining). Had D read it and died before
                        # answering, the lease may be D's: one attempt pulls a lease, so
                        # the next engine's ACQUIRE is refused (lease_busy, consumed: an
                        # error) or finds it released (it falls back per its policy);
                        # never two pulls, never a second release.
                        why = _closed_before_answering(up, exc)
                        raise _Unseen(_error(502, why), why, closed=why) from exc
                    # A timeout: D may be slow and pulling the lease; not handed on.
                    where = " mid-stream" if answered and stream_to is not None else ""
                    raise _LegFailed(_error(502, f"the decode engine {up.url} failed{where}: "
                                                 f"{type(exc).__name__}: {exc}")) from exc


async def _read_stream(r: httpx.Response, up: Upstream, leg: Leg, frame: Frame,
                       work: _Prefilling, stream_to: Callable[[Any], None]) -> None:
    """D's SSE chunks, each choice to ``stream_to``, until [DONE] (``stream_to(None)``);
    ``_LegFailed`` with D's error event, or when the stream ends early.

    After [DONE] the rest of D's body (its chunked end) is read, so that its connection
    goes back to the pool: left unread, httpcore closes the connection, and every
    streamed leg paid a new one (kvrelay bench front). The answer is complete by then:
    what comes there, or fails, is no longer the leg's."""
    landed = False
    lines = r.aiter_lines()
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            stream_to(None)
            with contextlib.suppress(httpx.HTTPError):
                async for _ in lines:
                    pass
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise _LegFailed(httpx.Response(502, json=chunk))
        frame.saw(chunk)
        if chunk.get("usage") and not chunk.get("choices"):
            leg.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not landed:
                landed = True
                _landed(up, leg)
                work.done()
            stream_to(choice)
    raise _LegFailed(_error(502, f"the decode engine {up.url} ended the stream early"))


class _LegFailed(Exception):
    """D did not answer the leg: ``response`` is the client's error (whole answers pass
    it on as it is; a stream sends its body as an error event)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class _Prefilling:
    """A leg's prefill work on an engine (Upstream.prefilling), counted from the request
    until ``done()``: its first token, or the end of the request however it ends."""

    def __init__(self, up: Upstream, tokens: float) -> None:
        self.up, self.tokens = up, tokens

    def __enter__(self) -> _Prefilling:
        self.up.prefilling += self.tokens
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()

    def done(self) -> None:
        self.up.prefilling -= self.tokens
        self.tokens = 0.0


def _local_work(leg: Leg) -> float:
    """The prompt tokens a decode engine computes for the leg: none when P prefilled it."""
    if leg.first is not None:
        return 0.0
    return leg.tokens if leg.local_tokens is None else leg.local_tokens


def _landed(up: Upstream, leg: Leg) -> None:
    """The decode engine answered the leg: it holds its prompt's KV now (computed or
    pulled), for conditional disaggregation's cached estimate."""
    if up.landed is not None:
        up.landed.insert(leg.chain)


async def _all(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` at once; the first failure cancels the rest and is raised as is."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


def _split(data: dict[str, Any], req: Any, chat: bool) -> list[Leg]:
    """One leg per prompt and choice; choice j of a prompt samples with seed + j."""
    base = {k: v for k, v in data.items() if k != "kv_transfer_params"}
    base["n"] = 1
    prompts: list[Any] = [None] if chat else req.prompts()
    legs = []
    for p_index, prompt in enumerate(prompts):
        for j in range(req.n):
            body = dict(base)
            if not chat:
                body["prompt"] = prompt
            if req.seed is not None:
                body["seed"] = req.seed + j
            legs.append(Leg(p_index * req.n + j, j == 0, body))
    return legs


def _closed_before_answering(up: Upstream, exc: Exception) -> str:
    return (f"the decode engine {up.url} closed the connection before answering: "
            f"{type(exc).__name__}: {exc}")


def _lease_lost(closed: str | None, status: int, body: dict[str, Any]) -> str | None:
    """After an engine closed the connection under a leg, the next engine's refusal of
    its lease (400 on kv_transfer_params: held or consumed by the first engine's
    attempt) is that close's consequence, not the client's error: the message of a 502
    naming both (None for any other answer)."""
    error = body.get("error")
    if closed is None or status != 400 or not isinstance(error, dict) \
            or error.get("param") != "kv_transfer_params":
        return None
    return f"{closed}; the lease went with it: {error.get('message')}"


