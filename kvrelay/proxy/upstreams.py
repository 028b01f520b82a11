"""The engines behind the proxy: each one's URL, role, load and prefix record, the set
of one role (health, DNS updates, routing by prefix and load), and how an engine's
failure is told apart from its refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from fastapi.responses import JSONResponse, Response

from kvrelay.proxy.affinity import PrefixRecord, Reason, RoutingConfig, choose
from kvrelay.proxy.events import EventRecord
from kvrelay.wire.http import error_event


class RouteKey(Protocol):
    """What routing reads of a leg: its prompt's hash chain and length in characters."""

    chain: list[int]
    text_len: int


class UpstreamDown(Exception):
    """An engine did not answer (connection refused, reset, timeout, 5xx)."""


class _Unseen(Exception):
    """A decode engine refused a leg before it saw it: the next one may take it.
    ``response``: the client's error should no engine take it; ``why``: for the log;
    ``busy``: a 429 (its queue of pulled requests is full), not a sign of ill health;
    ``closed``: it closed the connection before answering (this says how)."""

    def __init__(self, response: httpx.Response, why: str, busy: bool = False,
                 closed: str | None = None) -> None:
        super().__init__(why)
        self.response, self.why, self.busy, self.closed = response, why, busy, closed


# A connection closed under a request (reset, or EOF before a status line). Not a
# timeout: an engine that is slow to answer may hold the lease and be pulling it.
_CLOSED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class Refused(Exception):
    """An engine refused the request itself (4xx): the client gets its answer."""

    def __init__(self, r: httpx.Response) -> None:
        super().__init__(r.status_code)
        self.response = json_or_error(r)


@dataclass(eq=False)
class Upstream:
    url: str
    role: str
    prefixes: PrefixRecord  # the prompt prefixes sent here (KV-aware routing)
    outstanding: int = 0
    # A failed health check is not a reason to forget ``prefixes``: under load a check
    # can time out on an engine that lost nothing, and a record gone stale (the engine
    # restarted) costs one miss per prefix, after which the engine holds it again.
    healthy: bool = True
    # Conditional disaggregation: the prefixes this (decode) engine has computed or
    # pulled, recorded when its first token of a leg came back. ``prefixes`` takes a
    # prompt at routing, before the engine has it: a prefix still being prefilled on a P
    # (or on this engine) is not in its cache, and a prefill placed here on the strength
    # of it computes the whole prompt (the tail of the first benchmark runs).
    landed: PrefixRecord | None = None
    # Prompt tokens sent here to prefill and not yet answered by a first token: the
    # engine's prefill work in flight, for conditional disaggregation (_Prefilling).
    prefilling: float = 0.0
    _endpoints: dict[str, httpx.URL] = field(default_factory=dict, repr=False)

    def endpoint(self, path: str) -> httpx.URL:
        """``url`` + ``path``, parsed once: httpx parses a URL given as text on every
        request (~3% of the proxy's CPU per request, kvrelay bench front)."""
        url = self._endpoints.get(path)
        if url is None:
            url = self._endpoints[path] = httpx.URL(f"{self.url}{path}")
        return url


class Upstreams:
    def __init__(self, role: str, urls: list[str], config: RoutingConfig,
                 *, discovered: bool = False) -> None:
        if not urls and not discovered:
            raise ValueError(f"at least one --{role} URL is required")
        self.role, self.config = role, config
        self.all = [self._upstream(u.rstrip("/")) for u in urls]

    def _upstream(self, url: str, healthy: bool = True) -> Upstream:
        landed = PrefixRecord(self.config.cache_size) if self.role == "decode" else None
        return Upstream(url, self.role, _record(self.config), healthy=healthy, landed=landed)

    def update(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """The engines are now ``urls`` (DNS discovery): (added, removed). A new one
        joins unhealthy, so its health check comes before any request; a removed one's
        requests in flight hold their Upstream and finish."""
        want = {u.rstrip("/") for u in urls}
        have = {u.url for u in self.all}
        added, removed = sorted(want - have), sorted(have - want)
        self.all = [u for u in self.all if u.url in want] + [
            self._upstream(u, healthy=False) for u in added]
        return added, removed

    def candidates(self) -> list[Upstream]:
        """The healthy by outstanding requests, then the rest: a failed health check is
        a hint (the engine may be back since), not a verdict. A handful of engines:
        sorting them per request is fine."""
        return sorted(self.all, key=lambda u: (not u.healthy, u.outstanding))

    def pick(self) -> Upstream | None:
        """Least outstanding among the healthy; None when none is healthy."""
        best = self.candidates()[:1]
        return best[0] if best and best[0].healthy else None

    def route(self, leg: RouteKey) -> tuple[Upstream, Reason]:
        """The engine for ``leg`` by expected prefix reuse and load (proxy_affinity),
        and why; with KV-aware routing its record takes the leg's prompt at once, so
        requests with the same prefix that follow it (also ones already in flight) find
        it there."""
        up, reason = choose(self.all, leg.chain, leg.text_len, self.config)
        if self.config.kv_aware:
            up.prefixes.insert(leg.chain)
        return up, reason


def _record(config: RoutingConfig) -> PrefixRecord:
    """An engine's record: fed by its KV events (--kv-events), or by what was sent."""
    return EventRecord(config.cache_size) if config.kv_events else PrefixRecord(
        config.cache_size)


def _json_body(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
        if isinstance(body, dict) and "error" in body:
            return body
    except ValueError:
        pass
    text = r.text[:500]
    return error_event(f"the engine answered HTTP {r.status_code}: {text}", r.status_code)


def json_or_error(r: httpx.Response) -> Response:
    """An engine's answer passed on: its JSON body, an OpenAI error body for an error
    that is not one already."""
    if r.status_code < 400:
        try:
            return JSONResponse(r.json(), status_code=r.status_code)
        except ValueError:
            return JSONResponse(error_event(f"the engine answered HTTP "
                                                  f"{r.status_code} without JSON"), 502)
    retry = r.headers.get("retry-after")  # a draining engine's, for the client
    return JSONResponse(_json_body(r), status_code=r.status_code,
                        headers={"Retry-After": retry} if retry else None)


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json=error_event(message, status))
