"""``/v1/responses`` through the proxy: each request goes whole to one decode engine, as
colocated work (no prefill engine, no lease), and its answer or stream comes back as the
engine sent it. Tool calls are read out of the whole output there, and the stored
conversation behind ``previous_response_id`` lives on the engine that made the response:
the proxy remembers which engine made each response id (bounded, least recently used out
first) and sends a follow-up there.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvrelay.proxy.routing import Proxy
from kvrelay.proxy.upstreams import Upstream, json_or_error
from kvrelay.wire.http import ApiError, load_json, read_body
from kvrelay.wire.sse import EventStream

RESPONSES_PATH = "/v1/responses"
MAX_REMEMBERED = 65536  # response ids -> engine (about 100 bytes each)


class _Draining(Exception):
    """The engine refused the request unseen (503: draining, its loop down)."""


class ResponseRouter:
    def __init__(self, proxy: Proxy, max_remembered: int = MAX_REMEMBERED) -> None:
        self.proxy = proxy
        self.max_remembered = max_remembered
        self._made_by: OrderedDict[str, str] = OrderedDict()  # response id -> engine URL

    def remember(self, rid: Any, url: str) -> None:
        if not isinstance(rid, str):
            return
        self._made_by[rid] = url
        self._made_by.move_to_end(rid)
        while len(self._made_by) > self.max_remembered:
            self._made_by.popitem(last=False)

    def order(self, previous: Any) -> list[Upstream]:
        """The engine that made ``previous`` first, then the least loaded."""
        ups = self.proxy.decode.candidates()
        url = self._made_by.get(previous) if isinstance(previous, str) else None
        return sorted(ups, key=lambda u: u.url != url) if url else ups

    async def handle(self, request: Request) -> Response:
        raw = await read_body(request)
        body = load_json(raw)  # a 400 for a body that is not a JSON object
        ups = self.order(body.get("previous_response_id"))
        if not ups:
            raise ApiError(503, "no decode engine is known", type="server_error",
                           code="unavailable")
        failures = []
        for up in ups:
            try:
                if body.get("stream") is True:
                    return await self._stream(up, raw)
                return await self._whole(up, raw)
            except httpx.ConnectError as exc:  # the engine never saw it: the next one
                up.healthy = False
                failures.append(f"{up.url}: {type(exc).__name__}")
            except _Draining:
                failures.append(f"{up.url}: HTTP 503")
            except httpx.HTTPError as exc:
                raise ApiError(502, f"the engine {up.url} failed: {type(exc).__name__}: "
                               f"{exc}", type="server_error") from exc
        raise ApiError(503, "no decode engine answered: " + "; ".join(failures),
                       type="server_error", code="unavailable")

    def _post(self, up: Upstream, raw: bytes) -> httpx.Request:
        p = self.proxy
        return p._http().build_request(
            "POST", f"{up.url}{RESPONSES_PATH}", content=raw, timeout=p.timeout,
            headers={**p.headers(), "content-type": "application/json"})

    async def _whole(self, up: Upstream, raw: bytes) -> Response:
        async with self.proxy._outstanding(up):
            r = await self.proxy._http().send(self._post(up, raw))
        if r.status_code == 503:
            raise _Draining
        if r.status_code == 200:
            self.remember(_json(r).get("id"), up.url)
        return json_or_error(r)

    async def _stream(self, up: Upstream, raw: bytes) -> Response:
        client = self.proxy._http()
        r = await client.send(self._post(up, raw), stream=True)
        if r.status_code != 200:
            await r.aread()
            await r.aclose()
            if r.status_code == 503:
                raise _Draining
            return json_or_error(r)
        return EventStream(self._relay(up, r), on_close=lambda: None)

    async def _relay(self, up: Upstream, r: httpx.Response) -> AsyncIterator[bytes]:
        """The engine's events as they come; the response id from response.created."""
        try:
            async with self.proxy._outstanding(up):
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"response.created"' in line:
                        self.remember(load_json(line[5:].encode()).get("response", {})
                                      .get("id"), up.url)
                    yield (line + "\n").encode()
        except httpx.HTTPError as exc:
            err = {"type": "error", "code": "upstream_failed", "param": None,
                   "message": f"the engine {up.url} failed mid-stream: {exc}"}
            yield f"event: error\ndata: {_dumps(err)}\n\n".encode()
        finally:
            await r.aclose()


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))
