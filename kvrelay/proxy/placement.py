"""Conditional disaggregation: per choice, prefill on a prefill engine (P) or on the decode
engine (D) that will decode it.

A transfer pays for itself when P computes a long prompt D does not have: P's prefill
does not stall D's decode steps, and D pulls only the blocks it lacks. It does not when
D would compute little anyway (a short prompt, or a long one whose prefix D holds in its
cache) or when P has far more prefill work queued than D: then a prefill on D is the
cheaper path, with no lease, no pull and no second engine in the request's path (as
Dynamo's conditional disaggregation: its ``max_local_prefill_length`` and prefill queue
size). The rule, under ``--disaggregation conditional``, in this order:

1. ``local_short_prompt``: the prompt has at most ``--local-prefill-max-tokens`` tokens;
2. ``local_cached``: what D lacks of it (the prompt less the longest prefix D has
   answered before: Upstream.landed in kvrelay.proxy.routing) is at most that
   many tokens;
3. ``local_prefill_busy``: the prefill would finish sooner on D by at least
   ``--local-prefill-queue-tokens`` tokens of prefill work: every healthy P's
   tokens in flight plus what it would compute of this prompt exceed D's tokens in
   flight plus what D would compute by that many (0: never for this reason). A burst of
   cold long prompts is so split between P and D instead of queued on one engine.

else the choice is disaggregated. ``--disaggregation always`` (the default) never
prefills on D for these reasons, ``never`` always does (reason ``local_always``).

Work is counted in prompt tokens still to compute; "in flight" is what the proxy sent an
engine and has no first token of yet. The proxy sees text: a text prompt counts
``CHARS_PER_TOKEN`` characters a token (English text and common BPE vocabularies), a
prompt of token ids its ids. Pure: no clock, no I/O.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CHARS_PER_TOKEN", "MODES", "Local", "PlacementConfig", "Work", "add_placement_args",
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
    queue_tokens: int = 256  # --local-prefill-queue-tokens

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--disaggregation must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")
        if self.max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.max_tokens}")
        if self.queue_tokens < 0:
            raise ValueError("--local-prefill-queue-tokens must be >= 0 (0: off), "
                             f"got {self.queue_tokens}")


@dataclass(frozen=True)
class Work:
    """One choice's prefill as the rule sees it, in (estimated) prompt tokens."""

    prompt: float  # the prompt's length
    local: float  # what D would compute: the prompt less the prefix D holds
    local_queue: float  # D's prefill tokens in flight (sent, no first token yet)
    # The least, over the healthy prefill engines, of its tokens in flight plus what it
    # would compute of this prompt; None when none is healthy (the usual retries then).
    remote: float | None


def local_reason(config: PlacementConfig, work: Work) -> Local | None:
    """Why the choice prefills on its decode engine, or None: on a prefill engine."""
    if config.mode == "always":
        return None
    if config.mode == "never":
        return Local.ALWAYS
    if work.prompt <= config.max_tokens:
        return Local.SHORT
    if work.local <= config.max_tokens:
        return Local.CACHED
    if (config.queue_tokens and work.remote is not None
            and work.remote - (work.local_queue + work.local) >= config.queue_tokens):
        return Local.BUSY
    return None


def add_placement_args(p: argparse.ArgumentParser) -> None:
    d = PlacementConfig()
    p.add_argument("--disaggregation", choices=MODES, default=d.mode,
                   help="always: every prefill on a prefill engine; conditional: on the decode "
                   "engine when the prompt is short, mostly in its cache, or the prefill "
                   "engines far busier; never: every prefill on the decode engine")
    p.add_argument("--local-prefill-max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help="conditional: prefill on the decode engine when it would compute at "
                   "most N of the prompt's tokens (the prompt less the prefix it holds)")
    p.add_argument("--local-prefill-queue-tokens", type=int, default=d.queue_tokens,
                   metavar="N", help="conditional: prefill on the decode engine when every "
                   "healthy prefill engine has at least N more tokens of prefill work in "
                   "flight than the decode engine, this prompt counted on each (0: never "
                   "for this reason)")


def placement_from(args: argparse.Namespace) -> PlacementConfig:
    from kvrelay.errors import UsageError

    try:
        return PlacementConfig(args.disaggregation, args.local_prefill_max_tokens,
                               args.local_prefill_queue_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
