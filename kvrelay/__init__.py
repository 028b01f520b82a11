"""kvrelay: disaggregated LLM serving with an exactly-once KV lifecycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvrelay.model.kernels import choice as _kernel_choice

__version__ = "0.1.0"

# OpenMP threads that spin between parallel regions lose badly when the cores are
# shared: measured 5x slower decode steps with 2 threads on 2 busy cores
# (docs/model.md). So PASSIVE, after a spin of about 0.1 ms that spans the gaps inside
# a step (GOMP_SPINCOUNT), unless KVRELAY_OMP_WAIT_POLICY (or `kvrelay
# --omp-wait-policy`) asks otherwise. Only takes effect when torch is imported after
# kvrelay; OMP_WAIT_POLICY and GOMP_SPINCOUNT in the environment win.
_kernel_choice.apply_wait_policy()

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
