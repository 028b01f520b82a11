"""Prometheus metrics of one server, in a registry of its own (one per app).

Gauges read the engine's counters when scraped (reading an int or a dict's length
from another thread is safe under the GIL and needs no lock); counters and
histograms are updated by the request handlers as outputs arrive.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvrelay.core.engine import Engine
from kvrelay.model import kernel_choice

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)


class ServerMetrics:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name}
        pool, sched = engine.pool, engine.scheduler

        self.kv_blocks_total = Gauge(
            "kvrelay_kv_blocks_total", "KV cache blocks in the pool", registry=r
        )
        self.kv_blocks_total.set(pool.num_blocks)
        self.kv_blocks_free = Gauge("kvrelay_kv_blocks_free", "KV cache blocks free", registry=r)
        self.kv_blocks_free.set_function(lambda: pool.num_free)
        self.requests_running = Gauge(
            "kvrelay_requests_running", "requests scheduled in the engine", registry=r
        )
        self.requests_running.set_function(lambda: len(sched.running))
        self.requests_waiting = Gauge(
            "kvrelay_requests_waiting", "requests waiting for admission", registry=r
        )
        self.requests_waiting.set_function(lambda: len(sched.waiting))
        self.requests_finished = Counter(
            "kvrelay_requests_finished", "finished requests by finish reason", ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvrelay_prompt_tokens", "prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            "kvrelay_generation_tokens", "generated tokens", registry=r
        )
        self.ttft = Histogram(
            "kvrelay_time_to_first_token_seconds", "time from arrival to the first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "kvrelay_inter_token_latency_seconds", "time between two tokens of a request",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "kvrelay_e2e_request_latency_seconds", "time from arrival to the last token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.info = Gauge(
            "kvrelay_model_info", "the served model (value 1)", list(labels), registry=r
        )
        self.info.labels(**labels).set(1)
        kernels = kernel_choice.info()
        self.kernels = Gauge(
            "kvrelay_kernels_info", "layer kernels and OpenMP wait policy in use (value 1)",
            list(kernels), registry=r,
        )
        self.kernels.labels(**kernels).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
