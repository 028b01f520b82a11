"""Where a prompt chunk's attention runs under the native backend: on the native tiles,
through torch's SDPA, or on the AMX kernel, by the chunk's length, what it attends to,
the dtype and the CPU (KVRELAY_PREFILL_SDPA and KVRELAY_PREFILL_AMX override)."""

from __future__ import annotations

from typing import Any

import torch

from kvrelay import env
from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels.cpu import cpu_has_amx_bf16

# Where prompt chunks leave the native tiles for torch's SDPA: a chunk that attends to at
# least this many positions (its cached context and its own tokens), by the model's
# dtype, and has at least SDPA_MIN_TOKENS tokens (for fewer, SDPA would gather the whole
# context's K/V for little work). The tiles' cost per query grows with the context
# faster than SDPA's, and SDPA costs more per call; the crossings were measured per dtype
# and ISA (docs/notebook/, "Prompt attention by length"). bfloat16 on a CPU with
# AMX-BF16: SDPA (on AMX itself) for every chunk, or the AMX kernel where it can.
SDPA_FROM = {torch.float32: 640, torch.bfloat16: 320}
SDPA_MIN_TOKENS = 128
EVERY_PROMPT_CHUNK = 2  # a prompt chunk has two tokens or more, so attends to 2 or more
NEVER = 1 << 62  # no chunk attends to this many positions


def prefill_sdpa_from(dtype: torch.dtype) -> int | None:
    """From how many attended positions a prompt chunk goes to torch's SDPA instead of the
    native tiles, or None for never (KVRELAY_PREFILL_SDPA=1: every prompt chunk, =0:
    none; default: SDPA_FROM by dtype, every chunk for bfloat16 on AMX-BF16)."""
    forced = env.get("KVRELAY_PREFILL_SDPA")
    if forced is not None:
        return EVERY_PROMPT_CHUNK if forced else None
    if dtype is torch.bfloat16 and cpu_has_amx_bf16():
        return EVERY_PROMPT_CHUNK
    return SDPA_FROM.get(dtype)


def prefill_amx_available(mod: Any, dtype: torch.dtype, cfg: ModelConfig) -> bool:
    """Whether prompt chunks can attend through the AMX kernel: bfloat16, head_dim 64 or
    128, and a CPU with AMX-BF16 whose tile state Linux grants (KVRELAY_PREFILL_AMX=0:
    never)."""
    if not env.get("KVRELAY_PREFILL_AMX"):
        return False
    return (dtype is torch.bfloat16 and cfg.head_dim in (64, 128)
            and bool(mod.has_amx_prefill_attention()))
