"""KvRelayConnector's series on vLLM's ``/metrics`` (``build_prom_metrics``), made from
the ``KvRelayStats`` each worker step reports: ``vllm:kvrelay_*``, with the labels vLLM
gives every connector series (model name, engine index) plus ``reason`` where one is
counted by reason; counters are named as vLLM names its own (prometheus_client adds
``_total``). Imports vLLM: loaded only by the connector."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

PULL_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PULL_BYTES = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB


class KvRelayPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues

        def per_engine(cls: Any, name: str, doc: str, **kw: Any) -> dict[int, Any]:
            return create_metric_per_engine(
                cls(name=name, documentation=doc, labelnames=labelnames, **kw), engines)

        def by_reason(name: str, doc: str) -> tuple[Any, dict[int, list[object]]]:
            return self._counter_cls(name=name, documentation=doc,
                                     labelnames=[*labelnames, "reason"]), engines

        self.leases_made = per_engine(
            self._counter_cls, "vllm:kvrelay_leases_made",
            "Leases made on this prefill engine (one per request handed to a decode engine)")
        self.leases_ended, _ = by_reason(
            "vllm:kvrelay_leases_ended",
            "Leases ended, by reason: done (pulled and committed), aborted, expired, failed, "
            "not_made (the worker could not make it)")
        self.pulls = per_engine(
            self._counter_cls, "vllm:kvrelay_pulls",
            "KV pulls committed on this decode engine (the fence said done)")
        self.pull_seconds = per_engine(
            self._histogram_cls, "vllm:kvrelay_pull_seconds",
            "A pull's time: ACQUIRE answered to the commit confirmed", buckets=PULL_SECONDS)
        self.pull_bytes = per_engine(
            self._histogram_cls, "vllm:kvrelay_pull_bytes", "Bytes a committed pull copied",
            buckets=PULL_BYTES)
        self.fallbacks, _ = by_reason(
            "vllm:kvrelay_fallbacks",
            "Loads that did not commit, by reason (vLLM recomputes them, or fails them "
            "under kv_load_failure_policy fail)")
        self.fence_refused = per_engine(
            self._counter_cls, "vllm:kvrelay_fence_refused",
            "Copies whose commit the fence refused (the lease was lost or a block changed)")
        self.quarantined = per_engine(
            self._gauge_cls, "vllm:kvrelay_quarantined_requests",
            "Requests whose cancelled transfer has not stopped: their blocks stay theirs",
            multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        labels = self.per_engine_labelvalues[engine_idx]
        if d.get("leases_made"):
            self.leases_made[engine_idx].inc(d["leases_made"])
        for why, n in d.get("leases_ended", {}).items():
            self.leases_ended.labels(*labels, why).inc(n)
        for ms in d.get("load_ms", ()):
            self.pulls[engine_idx].inc()
            self.pull_seconds[engine_idx].observe(ms / 1000)
        for nbytes in d.get("load_bytes", ()):
            self.pull_bytes[engine_idx].observe(nbytes)
        for why, n in d.get("fallbacks", {}).items():
            self.fallbacks.labels(*labels, why).inc(n)
        if d.get("fence_refused"):
            self.fence_refused[engine_idx].inc(d["fence_refused"])
        if "quarantined" in d:
            self.quarantined[engine_idx].set(d["quarantined"])
