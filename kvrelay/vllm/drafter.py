"""Speculative decoding: which of vLLM's KV layers are the target model's.

A drafter that keeps KV (EAGLE, EAGLE-3, MTP, DFlash, DSpark, a separate draft model)
adds its attention layers to the same KV cache dict and the same block ids as the
target's (one KV cache group: `gpu_model_runner.initialize_kv_cache_tensors` hands the
connector every layer). ngram, suffix, medusa and mlp_speculator keep none. vLLM names
the drafter's layers after the target's: EAGLE/EAGLE-3/DFlash/MTP number them from the
target's layer count on (``model.layers.<n_target + i>``), a draft model prefixes
``draft_model.``.

The lease covers the target's layers only, on both sides: the layout and compat hash a
worker reports describe them alone, so a P without a drafter and a D with one agree, and
an engine without a drafter hashes as before. The drafter's layers are never moved.
What they hold for the pulled prompt positions: whatever the blocks held (zeros in a
fresh cache, another request's drafter KV in a reused block; vLLM zeroes new blocks only
for Mamba or mixed-precision caches). D cannot compute them: an EAGLE/MTP drafter needs
the target's hidden state at every prompt position (a prefill), a draft model a prefill
of its own, and vLLM runs the drafter only on the tokens the target ran this step: D's
drafter writes its KV from the recomputed last prompt token on. Only the drafts of the
first steps suffer (fewer accepted); the target verifies every draft, so the text is the
target's either way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# Methods whose proposer keeps no KV cache (vLLM 0.32-0.34 `SpeculativeMethod`); asked
# only of a vLLM without `uses_draft_kv_cache`.
NO_KV_METHODS = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
DRAFT_MODEL_PREFIX = "draft_model."
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Drafter:
    """A speculative method that adds KV layers, and the target model's layer count."""

    method: str
    target_layers: int


def drafter_of(vllm_config: Any) -> Drafter | None:
    """The engine's drafter with KV layers, None where it has none."""
    sc = getattr(vllm_config, "speculative_config", None)
    method = getattr(sc, "method", None)
    if sc is None or method is None:
        return None
    uses_kv = getattr(sc, "uses_draft_kv_cache", None)
    if not (uses_kv() if callable(uses_kv) else method not in NO_KV_METHODS):
        return None
    return Drafter(str(method), int(vllm_config.model_config.get_total_num_hidden_layers()))


def is_drafter_layer(name: str, target_layers: int) -> bool:
    """vLLM's naming: a draft model's prefix, or a layer number past the target's."""
    if name.startswith(DRAFT_MODEL_PREFIX):
        return True
    m = _LAYER_INDEX.search(name)
    return m is not None and int(m.group(1)) >= target_layers


def target_layers(kv_caches: Mapping[str, T], drafter: Drafter | None) -> dict[str, T]:
    """The target model's layers of ``kv_caches`` (all of them without a drafter).
    Raises ValueError naming the method where the rest is not the target's layer count:
    the drafter's layers could not be told apart, and a lease over a guess would be
    refused by every peer (or worse, agree with a peer that guessed the same wrong)."""
    if drafter is None:
        return dict(kv_caches)
    kept = {n: t for n, t in kv_caches.items() if not is_drafter_layer(n, drafter.target_layers)}
    local = [n for n in kv_caches if n not in kept]
    if len(kept) != drafter.target_layers:
        raise ValueError(
            f"KvRelayConnector with speculative decoding method {drafter.method!r}: of "
            f"{len(kv_caches)} KV layers, {len(kept)} look like the target model's, which "
            f"has {drafter.target_layers} (the drafter's are named draft_model.* or "
            f"numbered from {drafter.target_layers} on; these were taken as the drafter's: "
            f"{', '.join(local) or 'none'}). The connector moves the target's layers only "
            "and cannot tell them apart here: run this engine without "
            "--speculative-config, or use a method without KV (ngram, suffix)")
    if local:
        log.info("kvrelay: speculative decoding (%s): leases cover the target model's %d KV "
                 "layers; the drafter's %d (%s) stay local, computed by this engine from "
                 "the first token it runs on", drafter.method, len(kept), len(local),
                 ", ".join(local))
    return kept
