"""kvrelay: disaggregated LLM serving with an exactly-once KV lifecycle."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# OpenMP threads that spin between parallel regions lose badly when the cores are
# shared: measured 5x slower decode steps with 2 threads on 2 busy cores
# (docs/model.md). Sleeping threads cost a little wake-up latency instead. Only
# takes effect when torch is imported after kvrelay; the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from kvrelay.model.llm import LLM
    from kvrelay.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import kvrelay` does not import torch.
    if name == "LLM":
        from kvrelay.model.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvrelay.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
