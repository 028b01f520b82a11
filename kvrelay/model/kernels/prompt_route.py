"""Where a prompt chunk's attention runs under the native backend: on the native tiles
(the default), or through torch's SDPA or the AMX kernel (KVRELAY_PREFILL_SDPA=1,
KVRELAY_PREFILL_AMX)."""

from __future__ import annotations

from typing import Any

import torch

from kvrelay import env
from kvrelay.model.config import ModelConfig

# Prompt chunks attend on the native tiles by default, whatever their length: the tiles
# compute a query's output from its q and the context's K/V alone, in one order, the
# same as a decode row's, so a prompt answers the same cold, after a cached prefix,
# chunked or through P/D (docs/model.md, "One answer per request"). torch's SDPA and
# the AMX kernel (flash attention: blocks of keys sized by the call, a running max)
# were faster past a few hundred positions in float32 and on AMX, but a chunk's route
# then depended on its length, and a prompt computed in one chunk cold and as a short
# one after its cached prefix answered otherwise. KVRELAY_PREFILL_SDPA=1 sends every
# prompt chunk of two tokens or more there (to the AMX kernel where it can), trading
# that for speed on long prompts (docs/notebook/, "Prompt attention by length").
SDPA_MIN_TOKENS = 128
EVERY_PROMPT_CHUNK = 2  # a prompt chunk has two tokens or more, so attends to 2 or more
NEVER = 1 << 62  # no chunk attends to this many positions


def prefill_sdpa_from() -> int | None:
    """From how many attended positions a prompt chunk goes to torch's SDPA instead of the
    native tiles, or None for never (the default, every dtype alike;
    KVRELAY_PREFILL_SDPA=1: every prompt chunk)."""
    return EVERY_PROMPT_CHUNK if env.get("KVRELAY_PREFILL_SDPA") else None


def prefill_amx_available(mod: Any, dtype: torch.dtype, cfg: ModelConfig) -> bool:
    """Whether prompt chunks can attend through the AMX kernel: bfloat16, head_dim 64 or
    128, and a CPU with AMX-BF16 whose tile state Linux grants (KVRELAY_PREFILL_AMX=0:
    never)."""
    if not env.get("KVRELAY_PREFILL_AMX"):
        return False
    return (dtype is torch.bfloat16 and cfg.head_dim in (64, 128)
            and bool(mod.has_amx_prefill_attention()))
