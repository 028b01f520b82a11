"""vLLM's logits rules that depend on a request's tokens: frequency, presence and
repetition penalties, min_tokens and bad_words; and allowed_token_ids.

Semantics (vLLM's sampler and logits processors):
- repetition_penalty r over the tokens seen in the prompt or the output: a positive
  logit is divided by r, a negative one multiplied by it;
- frequency_penalty f and presence_penalty p over the output tokens only:
  ``logit -= f * count + p * (count > 0)``;
- min_tokens: EOS and stop_token_ids masked while fewer tokens are out;
- bad_words: a token sequence's last token is banned where the output so far ends
  with the tokens before it (a one-token word is always banned);
- allowed_token_ids: every other token masked.

Where the tokens come from: as ``GrammarMasks``, a request's tokens reach its history
as *inputs* of its steps (``observe``, before sampling), so the token P sampled, a
prefix-cache hit and a recomputation after preemption all count the same way, and the
history at sampling time is exactly the positions before the new token. Positions a
chunk skipped (a cached prefix, KV pulled from P) are read from ``all_token_ids``.

Cost: requests without these parameters are skipped by one attribute test per row.
Penalized requests keep their counts as a vocab-sized tensor on the logits' device,
updated with the step's new tokens only (O(new tokens), not O(output length)), and
the rows of a step are penalized together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvrelay.core.runner import ScheduledRequest
from kvrelay.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _History:
    prompt_len: int
    next_pos: int = 0  # sequence position of the next token to absorb
    output: list[int] = field(default_factory=list)
    # Tokens not yet folded into the tensors (made on the first sample: the device).
    new_prompt: list[int] = field(default_factory=list)
    new_output: list[int] = field(default_factory=list)
    prompt_seen: torch.Tensor | None = None  # (vocab,) bool, repetition_penalty only
    counts: torch.Tensor | None = None  # (vocab,) float32 output token counts


class TokenRules:
    """Per-request token histories of one runner (engine thread only)."""

    def __init__(self) -> None:
        self.eos_token_ids: tuple[int, ...] = ()  # masked by min_tokens
        self._hist: dict[str, _History] = {}
        self._allowed: dict[tuple[int, ...], torch.Tensor] = {}

    def observe(self, requests: Sequence[ScheduledRequest],
                resolve: Callable[[ScheduledRequest], list[int]]) -> None:
        for sr in requests:
            if not sr.params.needs_history:
                continue
            h = self._hist.get(sr.request_id)
            if h is None:
                h = self._hist[sr.request_id] = _History(sr.prompt_len)
            end = sr.start + len(sr.token_ids)
            if end <= h.next_pos:
                continue
            if sr.start > h.next_pos:
                known = sr.all_token_ids[h.next_pos:sr.start]
                if len(known) < sr.start - h.next_pos:
                    log.warning("request %s: penalties miss positions %d..%d",
                                sr.request_id, h.next_pos + len(known), sr.start)
                self._absorb(h, sr.params, h.next_pos, known)
                h.next_pos = sr.start
            tokens = resolve(sr)[h.next_pos - sr.start:]
            self._absorb(h, sr.params, h.next_pos, tokens)
            h.next_pos = end

    def forget(self, request_id: str) -> None:
        self._hist.pop(request_id, None)

    def mask(self, logits: torch.Tensor, params: Sequence[SamplingParams],
             request_ids: Sequence[str]) -> list[int]:
        """allowed_token_ids, bad_words and min_tokens on ``logits`` (n, vocab), in
        place; returns the rows ``penalize`` must see."""
        pen_rows: list[int] = []
        for i, p in enumerate(params):
            if p.allowed_token_ids is not None:
                logits[i].masked_fill_(self._forbidden(p.allowed_token_ids, logits), -torch.inf)
            if not p.needs_history:
                continue
            h = self._hist.get(request_ids[i]) if request_ids else None
            if h is None:
                raise ValueError("penalties, min_tokens and bad_words need the request ids "
                                 "of the batch and its observed tokens")
            self._mask_words(logits[i], p, h)
            if p.min_tokens and len(h.output) < p.min_tokens:
                stop = [t for t in (*self.eos_token_ids, *p.stop_token_ids)
                        if t < logits.shape[1]]
                logits[i, stop] = -torch.inf
            if p.penalized:
                pen_rows.append(i)
        return pen_rows

    def penalize(self, logits: torch.Tensor, rows: list[int],
                 params: Sequence[SamplingParams], request_ids: Sequence[str]) -> None:
        """Repetition, frequency and presence penalties of ``rows``, together, in place."""
        if not rows:
            return
        hists = [self._flush(self._hist[request_ids[i]], logits) for i in rows]
        sub_params = [params[i] for i in rows]
        dev, dt = logits.device, logits.dtype
        every_row = len(rows) == logits.shape[0]
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        # Every row penalized: in place on the logits, no gather and scatter.
        sub = logits if every_row else logits.index_select(0, idx)
        counts = torch.stack([h.counts for h in hists if h.counts is not None])
        seen_out = counts > 0
        reps = [p.repetition_penalty for p in sub_params]
        if any(r != 1.0 for r in reps):
            seen = seen_out.clone()
            for j, h in enumerate(hists):
                if h.prompt_seen is not None:
                    seen[j] |= h.prompt_seen
            rep = torch.tensor(reps, dtype=dt, device=dev)[:, None]
            factor = torch.where(sub > 0, 1.0 / rep, rep).masked_fill_(~seen, 1.0)
            sub.mul_(factor)
        freq = torch.tensor([p.frequency_penalty for p in sub_params], dtype=dt,
                            device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in sub_params], dtype=dt,
                            device=dev)[:, None]
        sub.sub_(counts.mul_(freq).add_(seen_out * pres))  # counts: a stacked copy
        if not every_row:
            logits.index_copy_(0, idx, sub)

    # -- internals --------------------------------------------------------------------
    def _absorb(self, h: _History, p: SamplingParams, pos: int, tokens: Sequence[int]) -> None:
        n_prompt = max(0, min(len(tokens), h.prompt_len - pos))
        if p.repetition_penalty != 1.0:
            h.new_prompt.extend(tokens[:n_prompt])
        out = tokens[n_prompt:]
        h.output.extend(out)
        if p.penalized:
            h.new_output.extend(out)

    def _forbidden(self, allowed: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor:
        mask = self._allowed.get(allowed)
        if mask is None or mask.device != logits.device:
            if len(self._allowed) > 64:  # a handful of distinct lists in practice
                self._allowed.clear()
            mask = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
            ids = [t for t in allowed if t < logits.shape[1]]
            mask[torch.tensor(ids, dtype=torch.long, device=logits.device)] = False
            self._allowed[allowed] = mask
        return mask

    @staticmethod
    def _mask_words(row: torch.Tensor, p: SamplingParams, h: _History) -> None:
        vocab = row.shape[0]
        for word in p.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix > len(h.output) or word[-1] >= vocab:
                continue
            if prefix == 0 or tuple(h.output[-prefix:]) == word[:-1]:
                row[word[-1]] = -torch.inf

    @staticmethod
    def _flush(h: _History, logits: torch.Tensor) -> _History:
        """Fold the tokens observed since the last sample into the tensors."""
        vocab, dev = logits.shape[1], logits.device
        if h.counts is None:
            h.counts = torch.zeros(vocab, dtype=logits.dtype, device=dev)
        if h.new_output:
            ids = torch.tensor([t for t in h.new_output if t < vocab], dtype=torch.long,
                               device=dev)
            h.counts.index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype, device=dev))
            h.new_output.clear()
        if h.new_prompt:
            if h.prompt_seen is None:
                h.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            ids = torch.tensor([t for t in h.new_prompt if t < vocab], dtype=torch.long,
                               device=dev)
            h.prompt_seen[ids] = True
            h.new_prompt.clear()
        return h
