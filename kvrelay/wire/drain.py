"""Draining: what an engine does between SIGTERM and its exit.

The first SIGTERM/SIGINT starts the drain (``DrainState.begin``, called by
kvrelay.wire.graceful). From then on the engine keeps its port open, so that:

- ``GET /health`` answers 503 ``draining`` with ``Retry-After`` (the proxy and a
  Kubernetes readiness probe stop sending it work);
- a new generation request gets the same 503, an OpenAI error body with code
  ``draining``, before the engine sees it (``DrainGate``): nothing was admitted, so the
  proxy sends the request to another engine, its lease untouched;
- requests already running finish, and everything else under ``/v1`` is served: a
  prefill engine's ``/v1/kv/release`` for the leases the proxy gives back.

``in_flight`` counts the ``/v1`` requests being served (a stream until its last byte
is sent); the server exits once it is 0 and the role has nothing pending (a prefill
engine: no lease held), or when the grace period ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# New work, refused while draining. Other routes (release, models, tokenize) are served.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class DrainState:
    """Read and written on the event loop's thread only (the signal handler runs there)."""

    grace_s: float = 10.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    started: float | None = None
    in_flight: int = 0

    @property
    def draining(self) -> bool:
        return self.started is not None

    def begin(self) -> bool:
        """Start draining; False when it had started already."""
        if self.started is not None:
            return False
        self.started = self.clock()
        return True

    def remaining(self) -> float:
        """Seconds of the grace period left (the whole period before the drain)."""
        if self.started is None:
            return self.grace_s
        return max(0.0, self.started + self.grace_s - self.clock())

    def headers(self) -> dict[str, str]:
        # By then this engine has exited; another one may have taken its place.
        return {"Retry-After": str(max(1, math.ceil(self.remaining())))}

    def error_body(self) -> dict[str, Any]:
        return {"error": {
            "message": "this engine is draining (shutting down): it finishes the requests it "
                       "has and takes no new ones; send the request to another engine",
            "type": "server_error", "param": None, "code": "draining"}}

    def refusal(self) -> JSONResponse:
        return JSONResponse(self.error_body(), status_code=503, headers=self.headers())


@dataclass
class DrainGate:
    """ASGI wrapper of an engine's app: counts ``/v1`` requests in flight and refuses new
    generation requests while draining."""

    app: App
    state: DrainState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.state.draining and path in GENERATION_PATHS:
            await self.state.refusal()(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
