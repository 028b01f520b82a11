"""Structured output: a JSON grammar per request, applied as a token mask.

The grammar library is llguidance (MIT, a dependency-free wheel). Per-token mask
cost on SmolLM2's 49152-token vocabulary, this machine (docs/model.md has the
table): llguidance about 80 us, xgrammar about 6-15 us, outlines-core about 70 us
(plus 58 ms to compile each schema, and no unbounded "any JSON" grammar).
xgrammar is faster, but it imports transformers at import time and its wheel
requires triton, so it could only be installed with ``--no-deps`` and
hand-declared dependencies; llguidance installs as a plain dependency, and its
cost is under 0.2% of a decode step per constrained request.

Who does what:
- ``kvrelay.wire.schema`` (request side, any thread): a response_format -> the
  opaque spec SamplingParams carries (its grammar string compiled), or
  ``InvalidParameter("response_format", ...)``.
- ``GrammarMasks`` (runner side, the engine thread only): one matcher per
  constrained request. A matcher is fed the request's output tokens as they come
  back as *inputs* of later steps (positions >= prompt_len), so a token sampled
  elsewhere (a prefill engine's first token, a recomputation after preemption)
  reaches it the same way as one sampled here; ``next_pos`` makes feeding
  idempotent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance as llg
import numpy as np

from kvrelay.core.runner import ScheduledRequest
from kvrelay.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class GrammarTokenizer:
    """The llguidance view of a ``tokenizers`` vocabulary, built once on first use
    (0.2-0.5 s for 49k tokens) from any thread."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_ids: Sequence[int]) -> None:
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._tok: llg.LLTokenizer | None = None

    def get(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tok is None:
                self._tok = llg.LLTokenizer(self._json(), n_vocab=self.vocab_size,
                                            eos_token=self.eos_ids)
            return self._tok


@dataclass(slots=True)
class _State:
    matcher: llg.LLMatcher
    next_pos: int  # sequence position of the next output token the matcher expects


class GrammarMasks:
    """Per-request grammar matchers of one runner (engine thread only)."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = tokenizer.eos_ids
        self._states: dict[str, _State] = {}

    def observe(
        self, requests: Sequence[ScheduledRequest],
        resolve: Callable[[ScheduledRequest], list[int]],
    ) -> None:
        """Feed each constrained request the output tokens among its chunk's inputs."""
        for sr in requests:
            spec = sr.params.structured
            if spec is None:
                continue
            state = self._states.get(sr.request_id)
            if state is None:
                state = self._states[sr.request_id] = _State(self._matcher(spec), sr.prompt_len)
            end = sr.start + len(sr.token_ids)
            if end <= state.next_pos:
                continue
            if sr.start > state.next_pos:
                log.warning("request %s: grammar skipped positions %d..%d", sr.request_id,
                            state.next_pos, sr.start)
            tokens = resolve(sr)[max(state.next_pos - sr.start, 0):]
            was_error = state.matcher.is_error()
            if not state.matcher.consume_tokens(tokens) and not was_error:
                # Sticky: from here on the request may only end (apply allows EOS).
                log.warning("request %s: output left the grammar: %s", sr.request_id,
                            state.matcher.get_error().splitlines()[0])
            state.next_pos = end

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], request_ids: Sequence[str]) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place, for ``rows``."""
        import torch  # here, not at import: the server validates grammars before torch
        # loads, and the CLI sets libgomp's wait policy before that (kernel_choice)

        vocab = logits.shape[1]
        words = (vocab + 31) // 32
        bits = np.zeros((len(rows), words), dtype=np.int32)
        for j, rid in enumerate(request_ids):
            state = self._states.get(rid)
            if state is None or state.matcher.is_error() or state.matcher.is_stopped():
                self._allow_only_eos(bits[j])
                continue
            state.matcher.unsafe_compute_mask_ptr(bits[j].ctypes.data, words * 4)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        # Branch-free: 0.0 where allowed, -inf (bits 0xFF800000) where not, then one add;
        # masked_fill on a mixed mask runs several times slower here.
        forbid = (allowed ^ 1).astype(np.uint32) * np.uint32(0xFF800000)
        penalty = torch.from_numpy(forbid.view(np.float32)).to(logits.device, logits.dtype)
        if list(rows) == list(range(logits.shape[0])):
            logits.add_(penalty)  # every row constrained: in place
            return
        idx = torch.tensor(list(rows), device=logits.device)
        logits.index_add_(0, idx, penalty)

    def _allow_only_eos(self, row: np.ndarray) -> None:
        words = row.view(np.uint32)
        words[:] = 0
        for t in self.eos_ids:
            words[t // 32] |= np.uint32(1 << (t % 32))

    def _matcher(self, spec: StructuredOutput) -> llg.LLMatcher:
        return llg.LLMatcher(self.tokenizer.get(), spec.grammar, log_level=0)
