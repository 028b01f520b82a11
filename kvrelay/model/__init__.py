"""The model package: loading, the Llama-family model, paged KV cache, sampling.

``load_model`` is imported lazily so ``import kvrelay.model.interface`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.model.loader import load_model

__all__ = ["load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from kvrelay.model.loader import load_model

        return load_model
    raise AttributeError(f"module 'kvrelay.model' has no attribute {name!r}")
