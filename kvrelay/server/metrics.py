"""Prometheus metrics of one server, in a registry of its own (one per app).

Gauges read the engine's counters when scraped (reading an int or a dict's length
from another thread is safe under the GIL and needs no lock); counters and
histograms are updated by the request handlers as outputs arrive.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvrelay.core.engine import Engine
from kvrelay.core.scheduler import Scheduler
from kvrelay.model.kernels import choice as kernel_choice
from kvrelay.server.vllm_metrics import VllmSeries

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)


_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0,
)


class ServerMetrics:
    """Every series carries ``model_name`` (the first served name), as vLLM's do.

    Per-request counts across a prefill/decode pair: the prompt (``prompt_tokens``,
    ``request_prompt_tokens``) is counted where it is computed, on P (D does not count
    a prompt whose KV it pulls, even when it recomputes after a failed pull); the
    output (``generation_tokens``, ``request_generation_tokens``) where each token is
    sampled: P's first token on P, the rest on D, and the per-request histogram by
    the engine that finishes the request for the client (D, with the first token).
    Summing a cluster's engines therefore counts each request once.

    vLLM's names (``vllm:*``, server/vllm_metrics.py) carry the same counts with vLLM's
    buckets and labels: each update below goes to both series.
    """

    def __init__(self, engine: Engine, model_name: str, *, cache_dtype: str = "auto"
                 ) -> None:
        # One ``_created`` gauge per counter and histogram: series nobody reads (vLLM
        # turns them off too). Process-wide, as every server in a process wants it.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model_name"]
        pool, sched = engine.pool, engine.scheduler
        # The queue-time histogram needs the engine to stamp each request's first step
        # with the clock the request side measures arrivals with.
        engine.clock = time.monotonic

        Gauge("kvrelay_kv_blocks_total", "KV cache blocks in the pool", m,
              registry=r).labels(model_name).set(pool.num_blocks)
        Gauge("kvrelay_kv_blocks_free", "KV cache blocks free", m,
              registry=r).labels(model_name).set_function(lambda: pool.num_free)
        Gauge("kvrelay_kv_blocks_cached", "KV cache blocks nobody holds that keep a "
              "prefix for later hits (evicted on demand); free + cached + in use == total",
              m, registry=r).labels(model_name).set_function(lambda: pool.num_cached)
        Gauge("kvrelay_requests_running", "requests scheduled in the engine", m,
              registry=r).labels(model_name).set_function(lambda: len(sched.running))
        Gauge("kvrelay_requests_waiting", "requests waiting for admission", m,
              registry=r).labels(model_name).set_function(lambda: len(sched.waiting))
        self._finished = Counter(
            "kvrelay_requests_finished", "finished requests by finish reason",
            [*m, "reason"], registry=r,
        )
        self._model = model_name
        self.vllm = v = VllmSeries(r, engine, model_name, cache_dtype=cache_dtype)
        self.prompt_tokens = _Counters(v.prompt_tokens, Counter(
            "kvrelay_prompt_tokens", "prompt tokens of accepted requests (on P for a "
            "disaggregated request)", m, registry=r).labels(model_name))
        self.generation_tokens = _Counters(v.generation_tokens, Counter(
            "kvrelay_generation_tokens", "tokens sampled by this engine", m,
            registry=r).labels(model_name))
        self.request_prompt_tokens = _Histograms(v.request_prompt_tokens, Histogram(
            "kvrelay_request_prompt_tokens", "prompt tokens per accepted request (on P for "
            "a disaggregated request)", m, buckets=_TOKEN_BUCKETS, registry=r,
        ).labels(model_name))
        self.request_generation_tokens = _Histograms(v.request_generation_tokens, Histogram(
            "kvrelay_request_generation_tokens", "output tokens per finished request (the "
            "first token included; on D for a disaggregated request)", m,
            buckets=_TOKEN_BUCKETS, registry=r,
        ).labels(model_name))
        self.queue_time = _Histograms(v.queue_time, Histogram(
            "kvrelay_request_queue_time_seconds", "time from hand-off to the engine to the "
            "request's first step (on D: includes the KV pull)", m, buckets=_QUEUE_BUCKETS,
            registry=r,
        ).labels(model_name))
        self.ttft = _Histograms(v.ttft, Histogram(
            "kvrelay_time_to_first_token_seconds", "time from arrival to the first token",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(model_name))
        self.itl = _Histograms(v.itl, Histogram(
            "kvrelay_inter_token_latency_seconds", "time between two tokens of a request",
            m, buckets=_ITL_BUCKETS, registry=r,
        ).labels(model_name))
        self.e2e = _Histograms(v.e2e, Histogram(
            "kvrelay_e2e_request_latency_seconds", "time from arrival to the last token",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(model_name))
        Gauge("kvrelay_model_info", "the served model (value 1)", m,
              registry=r).labels(model_name).set(1)
        kernels = kernel_choice.info()
        Gauge("kvrelay_kernels_info", "layer kernels and OpenMP wait policy in use (value 1)",
              [*m, *kernels], registry=r).labels(model_name, *kernels.values()).set(1)
        r.register(_SchedulerCounters(sched, model_name))

    def register(self, collector: Collector) -> None:
        """Export another collector's families (the relay's) with ``model_name`` added to
        every sample, like the engine's own series."""
        self.registry.register(_WithModelName(collector, self._model))

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model, reason).inc()
        self.vllm.finished(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Counters:
    """One increment to a vLLM-named counter and its ``kvrelay_*`` twin."""

    def __init__(self, *counters: Counter) -> None:
        self.counters = counters

    def inc(self, n: float = 1) -> None:
        for c in self.counters:
            c.inc(n)


class _Histograms:
    """One observation to a vLLM-named histogram and its ``kvrelay_*`` twin (their
    buckets differ)."""

    def __init__(self, *histograms: Histogram) -> None:
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for h in self.histograms:
            h.observe(value)


class _SchedulerCounters(Collector):
    """The scheduler's own counts, read at scrape time (int reads under the GIL)."""

    def __init__(self, sched: Scheduler, model_name: str) -> None:
        self.sched, self.model_name = sched, model_name

    def collect(self) -> Iterable[Metric]:
        prefix = self.sched.prefix_stats
        for name, doc, value in (
            ("kvrelay_preemptions", "running requests preempted (blocks freed, recomputed "
             "later) for lack of KV blocks", self.sched.num_preemptions),
            ("kvrelay_prefix_cache_queries", "tokens of admitted requests looked up in the "
             "prefix cache", prefix.queries),
            ("kvrelay_prefix_cache_hits", "tokens of admitted requests found in the prefix "
             "cache (not computed again)", prefix.hits),
            ("kvrelay_prefix_cache_evictions", "cached blocks evicted (made free) to make "
             "room for new ones", self.sched.pool.num_evictions),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class _WithModelName(Collector):
    def __init__(self, inner: Collector, model_name: str) -> None:
        self.inner, self.model_name = inner, model_name

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={"model_name": self.model_name, **s.labels})
                           for s in family.samples]
            yield out
