"""What the engine core hands a model runner, and what it gets back.

A runner computes one step: for every scheduled request, the KV of a chunk of its
tokens is written into its blocks (positions ``start`` .. ``start + len(token_ids)``)
and, where ``sample`` is set, one token is sampled from the logits of the chunk's
last position. The runner only borrows block ids; it never allocates or frees.

Async scheduling: a decode chunk may end with ``PLACEHOLDER``, meaning "the token
you sampled for this request in the previous step" (not yet known to the core
when this step was scheduled). The runner keeps its last sampled token per
request to resolve it.

Step completion: a runner on an asynchronous device (CUDA) may return, or raise,
while kernels of the step still write its requests' blocks. Before it does, it sets
``batch.completion`` to a token that says when that device work is done (a CUDA event
recorded after the forward); the default, ``COMPLETE``, is right for a runner whose
work is done when it returns (the CPU). The engine releases no block a step references
before that step's token is done (docs/core.md, "The in-flight fence").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrelay.sampling_params import SamplingParams

PLACEHOLDER = -1


class StepToken(Protocol):
    """When a step's device work (every write into its requests' blocks) is done."""

    def done(self) -> bool:
        """True once the work is done; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the work is done (bounded by the device, not by a peer)."""
        ...


class _Complete:
    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


# The token of a step whose work was done when the runner returned: one shared object,
# so a CPU step allocates nothing for it.
COMPLETE: StepToken = _Complete()


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the chunk to compute; the last may be PLACEHOLDER
    start: int  # position of token_ids[0] in the request's sequence
    block_ids: list[int]  # the request's block table (read-only for the runner)
    sample: bool  # sample a token at position start + len(token_ids)
    params: SamplingParams
    prompt_len: int
    # The request's known tokens (prompt, then outputs), borrowed read-only; positions
    # from its length on are samples of in-flight steps. A chunk may start after a
    # cached prefix the runner never saw: this is where those tokens are.
    all_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class Batch:
    step_id: int
    requests: list[ScheduledRequest] = field(default_factory=list)
    # Requests that finished since the previous batch: the runner may drop its
    # per-request state (last sampled token, sampler generators).
    finished_ids: list[str] = field(default_factory=list)
    # Set by the runner before it returns or raises (see the module's docstring).
    completion: StepToken = COMPLETE

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # the top-n (token id, logprob), best first
    rank: int = 0  # of the token in its distribution (1: the most likely); 0: not computed


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None
    # With params.prompt_logprobs, on the request's first sampled token: the logprobs
    # of prompt tokens 1.. (token 0 has none), computed over the prompt's chunks.
    prompt_logprobs: list[TokenLogprobs] | None = None


class Runner(Protocol):
    def execute(self, batch: Batch) -> Mapping[str, SampledToken]:
        """Run one step; return a sampled token for every request with ``sample`` set.
        A runner whose device may still write the step's blocks after it returns (or
        raises) sets ``batch.completion`` first."""
        ...
