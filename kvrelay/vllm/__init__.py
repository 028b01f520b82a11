"""kvrelay's relay as a vLLM KV connector (docs/vllm.md).

    --kv-transfer-config '{"kv_connector": "KvRelayConnector",
                           "kv_connector_module_path": "kvrelay.vllm", ...}'

vLLM imports this module and takes ``KvRelayConnector`` from it: only then is the
connector (and vLLM) imported, so ``import kvrelay`` and the vLLM-free halves here
(settings, prefill, decode) never import vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvRelayConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvRelayConnector":
        from kvrelay.vllm.connector import KvRelayConnector

        return KvRelayConnector
    raise AttributeError(f"module 'kvrelay.vllm' has no attribute {name!r}")
