"""vLLM's metric names on a kvrelay engine's ``/metrics``, so that the routers,
autoscalers and dashboards that read vLLM's (llm-d's endpoint picker, the Gateway API
inference extension, vllm-router's load-aware policies, KEDA/HPA recipes) see a kvrelay
engine as they see a vLLM one.

Names, types, buckets and labels are vLLM 0.34's (``vllm/v1/metrics/loggers.py`` and
``buckets.py``): labels ``model_name`` and ``engine`` ("0": one engine core per server),
plus ``finished_reason`` on ``request_success``. The values are kvrelay's own counts
(docs/operations.md, "vLLM's names", says what each means here); the ``kvrelay_*``
series stay beside them.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.core.engine import Engine

LABELS = ("model_name", "engine")
ENGINE = "0"

# vLLM 0.34, vllm/v1/metrics/buckets.py
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
# vLLM's finish reasons (vllm/v1/engine FinishReason), every one exported from the start.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's ``request_tokens`` family: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def finished_reason(reason: str) -> str:
    """A kvrelay finish reason as vLLM counts it: P's ``remote_decode`` is vLLM P's
    ``length`` (its max_tokens of 1), ``tool_calls`` is the model's ``stop``."""
    return {"remote_decode": "length", "tool_calls": "stop"}.get(reason, reason)


class VllmSeries:
    """The vLLM-named series one server updates (the scheduler's state is read at
    scrape time by ``_VllmState``)."""

    def __init__(self, registry: CollectorRegistry, engine: Engine, model_name: str, *,
                 cache_dtype: str = "auto") -> None:
        r, lab = registry, list(LABELS)
        values = (model_name, ENGINE)
        max_len = engine.config.max_model_len

        def counter(name: str, doc: str) -> Counter:
            c: Counter = Counter(name, doc, lab, registry=r).labels(*values)
            return c

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            h: Histogram = Histogram(name, doc, lab, buckets=tuple(buckets),
                                     registry=r).labels(*values)
            return h

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens "
                                     "processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.")
        tokens = request_tokens_buckets(max_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*lab, "finished_reason"], registry=r)
        self._success = {why: success.labels(*values, why) for why in FINISHED_REASONS}
        self._success_family = success
        self._values = values
        config = engine.config
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ["block_size", "cache_dtype", "enable_prefix_caching", "num_cpu_blocks",
               "num_gpu_blocks", "engine"], registry=r,
              ).labels(str(config.block_size), cache_dtype, str(config.enable_prefix_caching),
                       "None", str(engine.pool.num_blocks), ENGINE).set(1)
        r.register(_VllmState(engine, values))

    def finished(self, reason: str) -> None:
        why = finished_reason(reason)
        counter = self._success.get(why)
        if counter is None:  # a reason vLLM lacks: counted under its own name
            counter = self._success[why] = self._success_family.labels(*self._values, why)
        counter.inc()


class _VllmState(Collector):
    """The scheduler's and the pool's state, read when scraped (int reads under the GIL).

    ``kv_cache_usage_perc`` counts the blocks requests hold: a block that only keeps a
    prefix for later hits is free to take, as in vLLM (its free queue holds them)."""

    def __init__(self, engine: Engine, values: tuple[str, str]) -> None:
        self.engine, self.values = engine, list(values)

    def collect(self) -> Iterable[Metric]:
        sched, pool = self.engine.scheduler, self.engine.pool
        lab = list(LABELS)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             len(sched.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             len(sched.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             pool.num_in_use / pool.num_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric(self.values, value)
            yield g
        prefix = sched.prefix_stats
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
             "queried tokens.", prefix.queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
             "tokens.", prefix.hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             sched.num_preemptions),
        ):
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric(self.values, value)
            yield c
