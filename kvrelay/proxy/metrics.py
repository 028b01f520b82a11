"""The proxy's own Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)


class ProxyMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # as the engines do (kvrelay.server.metrics)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvrelay_proxy_requests", "Choices (one per prompt and n) by the path they took",
            ["path"], registry=r,
        )
        self.prefill_failures = Counter(
            "kvrelay_proxy_prefill_failures", "Prefill engines that failed a request", registry=r
        )
        self.client_disconnects = Counter(
            "kvrelay_proxy_client_disconnects", "Clients that went away mid-request", registry=r
        )
        self.outstanding = Gauge(
            "kvrelay_proxy_outstanding", "Requests in flight per engine", ["role", "url"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvrelay_proxy_engine_healthy", "1 if the engine answers /health", ["role", "url"],
            registry=r,
        )
        self.route = Counter(
            "kvrelay_proxy_route", "Engines picked per choice, by role and the reason: "
            "prefix_match (the longest cached prefix), least_outstanding (no match worth "
            "it, or KV-aware routing off), load_balance (a match, on an engine too busy), "
            "no_healthy; for role prefill also local_short_prompt, local_cached, "
            "local_prefill_busy, local_always (prefilled on the decode engine: "
            "--disaggregation)", ["role", "reason"], registry=r,
        )
        self.ttft = Histogram(
            "kvrelay_proxy_time_to_first_token_seconds",
            "Time to the first token as the client sees it", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
