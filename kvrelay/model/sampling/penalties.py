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
Penalized requests keep their distinct tokens (and output counts), updated with the
step's new tokens only; a step changes only the logits of those tokens, all rows
gathered and scattered together (``penalize``): O(distinct tokens seen), never a pass
over rows x vocabulary.
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
    # Distinct output tokens and their counts (frequency, presence), slot by slot.
    out_slot: dict[int, int] = field(default_factory=dict)
    out_ids: list[int] = field(default_factory=list)
    out_counts: list[float] = field(default_factory=list)
    # Distinct tokens of prompt and output (repetition): a tensor, plus the ones seen
    # since it was made.
    seen: set[int] = field(default_factory=set)
    seen_ids: torch.Tensor | None = None
    seen_new: list[int] = field(default_factory=list)


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
        """Repetition, frequency and presence penalties of ``rows``, in place.

        Sparse: only the logits of tokens a request has seen change, so the work is
        O(distinct tokens seen), gathered and scattered for all rows at once, not
        passes over (rows x vocab) as a dense count matrix would need."""
        if not rows:
            return
        flat = logits.view(-1) if logits.is_contiguous() else logits.contiguous().view(-1)
        vocab, dev, dt = logits.shape[1], logits.device, logits.dtype
        rep_idx, rep_val, cnt_idx, cnt_val = [], [], [], []
        for i in rows:
            p, h = params[i], self._hist[request_ids[i]]
            base = i * vocab
            if p.repetition_penalty != 1.0:
                ids = self._seen_ids(h, dev, vocab)
                rep_idx.append(ids + base)
                rep_val.append(torch.full((len(ids),), p.repetition_penalty, dtype=dt,
                                          device=dev))
            if h.out_ids and (p.frequency_penalty or p.presence_penalty):
                ids = torch.tensor(h.out_ids, dtype=torch.long, device=dev)
                counts = torch.tensor(h.out_counts, dtype=dt, device=dev)
                keep = ids < vocab
                cnt_idx.append(ids[keep] + base)
                cnt_val.append((counts * p.frequency_penalty + p.presence_penalty)[keep])
        if rep_idx:
            idx, rep = torch.cat(rep_idx), torch.cat(rep_val)
            vals = flat[idx]
            flat[idx] = torch.where(vals > 0, vals / rep, vals * rep)
        if cnt_idx:
            flat.index_add_(0, torch.cat(cnt_idx), -torch.cat(cnt_val))
        if flat.data_ptr() != logits.data_ptr():
            logits.copy_(flat.view_as(logits))

    # -- internals --------------------------------------------------------------------
    def _absorb(self, h: _History, p: SamplingParams, pos: int, tokens: Sequence[int]) -> None:
        n_prompt = max(0, min(len(tokens), h.prompt_len - pos))
        out = tokens[n_prompt:]
        h.output.extend(out)
        if p.repetition_penalty != 1.0:
            for t in tokens:
                if t not in h.seen:
                    h.seen.add(t)
                    h.seen_new.append(t)
        if p.frequency_penalty or p.presence_penalty:
            for t in out:
                slot = h.out_slot.get(t)
                if slot is None:
                    h.out_slot[t] = len(h.out_ids)
                    h.out_ids.append(t)
                    h.out_counts.append(1.0)
                else:
                    h.out_counts[slot] += 1.0

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
    def _seen_ids(h: _History, dev: torch.device, vocab: int) -> torch.Tensor:
        """The distinct prompt and output tokens, as a tensor grown by the new ones."""
        if h.seen_new or h.seen_ids is None:
            new = torch.tensor([t for t in h.seen_new if t < vocab], dtype=torch.long,
                               device=dev)
            h.seen_ids = new if h.seen_ids is None else torch.cat([h.seen_ids, new])
            h.seen_new.clear()
        return h.seen_ids
