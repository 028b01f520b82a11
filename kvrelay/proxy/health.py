"""Which engines the proxy may route to: each one's ``/health`` polled every
``--health-interval`` seconds (with the DNS names refreshed and the KV-event feeds
looked after on the same beat). A failed check is a hint, not a verdict: an unhealthy
engine is still tried when no healthy one is left (Upstreams.candidates)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from kvrelay.proxy.discovery import Discovery
from kvrelay.proxy.events import KvEventsFeed
from kvrelay.proxy.metrics import ProxyMetrics
from kvrelay.proxy.upstreams import Upstreams

log = logging.getLogger(__name__)


async def watch_health(
    prefill: Upstreams, decode: Upstreams, client: httpx.AsyncClient,
    headers: dict[str, str], metrics: ProxyMetrics, *, interval: float,
    discovery: Discovery | None = None, kv_events: KvEventsFeed | None = None,
) -> None:
    """Each poll is logged at debug; a change of an engine's health at info. Runs until
    cancelled; no failure of one check stops it."""
    while True:
        if discovery is not None:
            for role, url in await discovery.refresh([prefill, decode]):
                with contextlib.suppress(KeyError):  # gone before its first check
                    metrics.healthy.remove(role, url)
        for up in prefill.all + decode.all:
            try:
                r = await client.get(f"{up.url}/health", timeout=2.0)
                healthy, why = r.status_code == 200, f"HTTP {r.status_code}"
            except Exception as exc:  # any failure: unhealthy, and the loop goes on
                healthy, why = False, f"{type(exc).__name__}: {exc}"
            log.debug("health %s %s: %s", up.role, up.url, why)
            if healthy != up.healthy:
                log.info("%s engine %s is %s (%s)", up.role, up.url,
                         "healthy" if healthy else "unhealthy", why)
            up.healthy = healthy
            metrics.healthy.labels(up.role, up.url).set(1 if healthy else 0)
        if kv_events is not None:
            await kv_events.refresh(prefill.all + decode.all, client, headers)
        await asyncio.sleep(interval)
