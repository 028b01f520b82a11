"""Conditional disaggregation: per choice, prefill on a prefill engine (P) or on the decode
engine (D) that will decode it.

A transfer pays for itself when P computes a long prompt D does not have: P's prefill
does not stall D's decode steps, and D pulls only the blocks it lacks. It does not when
D would compute little anyway (a short prompt, or a long one whose prefix D most likely
holds in its cache) or when P is busy: then a prefill on D is the cheaper path, with no
lease, no pull and no second engine in the request's path (as Dynamo's conditional
disaggregation: its ``max_local_prefill_length`` and prefill queue size). The rule, under
``--disaggregation conditional``, in this order:

1. ``local_short_prompt``: the prompt has at most ``--local-prefill-max-tokens`` tokens;
2. ``local_cached``: what D's cache most likely lacks of it (the prompt less D's expected
   prefix match, kvrelay.server.proxy_affinity) is at most that many tokens;
3. ``local_prefill_busy``: every healthy prefill engine already has at least
   ``--local-prefill-queue`` prefills in flight (0: never for this reason);

else the choice is disaggregated. ``--disaggregation always`` (the default) never
prefills on D for these reasons, ``never`` always does (reason ``local_always``).

The proxy sees text: a text prompt counts ``CHARS_PER_TOKEN`` characters a token
(English text and common BPE vocabularies), a prompt of token ids its ids. Pure: no
clock, no I/O.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CHARS_PER_TOKEN", "MODES", "Local", "PlacementConfig", "add_placement_args",
           "local_reason", "placement_from"]

MODES = ("always", "conditional", "never")
CHARS_PER_TOKEN = 4.0


class Local(StrEnum):
    """Why a choice's prefill went to its decode engine: a ``reason`` of
    ``kvrelay_proxy_route_total{role="prefill"}``."""

    SHORT = "local_short_prompt"
    CACHED = "local_cached"
    BUSY = "local_prefill_busy"
    ALWAYS = "local_always"  # --disaggregation never


@dataclass(frozen=True)
class PlacementConfig:
    mode: str = "always"
    max_tokens: int = 256  # --local-prefill-max-tokens
    queue: int = 2  # --local-prefill-queue

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--disaggregation must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")
        if self.max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.max_tokens}")
        if self.queue < 0:
            raise ValueError(f"--local-prefill-queue must be >= 0 (0: off), got {self.queue}")


def local_reason(config: PlacementConfig, prompt_tokens: float, cached_fraction: float,
                 prefill_load: int | None) -> Local | None:
    """Why the choice prefills on its decode engine, or None: on a prefill engine.

    ``prompt_tokens``: the prompt's (estimated) length; ``cached_fraction``: the part of it
    expected in D's prefix cache (0 to 1); ``prefill_load``: the fewest prefills in flight
    on a healthy prefill engine, None when none is healthy (the usual retries then)."""
    if config.mode == "always":
        return None
    if config.mode == "never":
        return Local.ALWAYS
    if prompt_tokens <= config.max_tokens:
        return Local.SHORT
    if prompt_tokens * (1.0 - min(1.0, max(0.0, cached_fraction))) <= config.max_tokens:
        return Local.CACHED
    if config.queue and prefill_load is not None and prefill_load >= config.queue:
        return Local.BUSY
    return None


def add_placement_args(p: argparse.ArgumentParser) -> None:
    d = PlacementConfig()
    p.add_argument("--disaggregation", choices=MODES, default=d.mode,
                   help="always: every prefill on a prefill engine; conditional: on the decode "
                   "engine when the prompt is short, mostly in its cache, or every prefill "
                   "engine busy; never: every prefill on the decode engine")
    p.add_argument("--local-prefill-max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help="conditional: prefill on the decode engine when it would compute at "
                   "most N of the prompt's tokens (the prompt less its expected cached prefix)")
    p.add_argument("--local-prefill-queue", type=int, default=d.queue, metavar="N",
                   help="conditional: prefill on the decode engine when every healthy prefill "
                   "engine has N prefills in flight (0: never for this reason)")


def placement_from(args: argparse.Namespace) -> PlacementConfig:
    from kvrelay.cli import UsageError

    try:
        return PlacementConfig(args.disaggregation, args.local_prefill_max_tokens,
                               args.local_prefill_queue)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
