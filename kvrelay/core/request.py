"""A request as the engine core sees it: token ids, blocks and lifecycle state."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.block_pool import Owner, request_owner
from kvrelay.core.lifecycle import Event, FinishReason, RequestState, next_state
from kvrelay.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_len: int
    # Prompt followed by the output tokens known so far.
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Prefill side of a disaggregated pair: stop after the first token and hand the
    # KV to a lease instead of freeing it.
    remote_decode: bool = False
    # Decode side of a disaggregated pair: where the prompt's KV comes from (the
    # relay's kv_transfer_params). Admission allocates the prompt's blocks and parks
    # the request in WAITING_FOR_KV; cleared when the request falls back to recompute.
    remote_kv: object | None = None
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Tokens whose KV is written, or scheduled to be written by an in-flight step.
    num_computed_tokens: int = 0
    # Tokens sampled by in-flight steps and not yet known (async scheduling).
    num_pending_samples: int = 0
    # Steps scheduled with this request that have not landed (output not applied, or
    # device work not done): the fence. No release or preemption while it is nonzero.
    in_flight: int = 0
    block_ids: list[int] = field(default_factory=list)
    owner: Owner = ""
    # Prefix caching: the hash chain of its full blocks so far, and how many leading
    # blocks are published or shared.
    block_hashes: list[bytes] = field(default_factory=list)
    num_published: int = 0
    # Decode side: leading prompt blocks found in this engine's prefix cache when it was
    # admitted to wait for remote KV. They are shared, not pulled: the transfer writes
    # only into the blocks after them (a partial pull).
    num_cached_blocks: int = 0
    # False once it decodes on KV pulled from a relay that could not be authenticated:
    # it never publishes blocks (a forged relay must not poison others' prefix hits).
    shareable: bool = True
    # When the first step that computes it was scheduled (the engine's clock, if any).
    scheduled_at: float | None = None

    def __post_init__(self) -> None:
        if not self.owner:
            self.owner = request_owner(self.request_id)

    def transition(self, event: Event) -> None:
        self.state = next_state(self.request_id, self.state, event)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_tokens_scheduled_to_exist(self) -> int:
        """Known tokens plus the ones in-flight steps will sample."""
        return len(self.token_ids) + self.num_pending_samples

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]
