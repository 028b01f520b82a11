"""vLLM's ``prompt_logprobs``: the logprob of every prompt token after the first (with
its rank and top alternatives), for evaluation harnesses that score a text.

The runner asks ``rows`` which positions of a chunk predict prompt tokens not yet
scored, computes those rows' logits with the step's forward pass (the logits of
position p score token p + 1), and hands them to ``record``. The sampler attaches the
whole list to the request's first sampled token (``take``), which the core passes on
as ``RequestOutput.prompt_logprobs``. The scheduler gives such requests no prefix-cache
hit, so every prompt position is computed; a recomputation after preemption scores
nothing twice (``next_target``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrelay.core.runner import ScheduledRequest, TokenLogprobs

_SLICE = 256  # rows per log-softmax


@dataclass(slots=True)
class _Acc:
    prompt_len: int
    next_target: int = 1  # the next prompt position to score
    items: list[TokenLogprobs] = field(default_factory=list)
    taken: bool = False


class PromptLogprobs:
    """Per-request prompt logprobs being computed over its chunks (engine thread)."""

    def __init__(self) -> None:
        self._acc: dict[str, _Acc] = {}

    def rows(self, sr: ScheduledRequest, first_row: int) -> tuple[list[int], list[int]] | None:
        """(rows of this step's tokens whose logits score prompt tokens, those tokens),
        or None when the chunk scores none; ``first_row``: the row of sr.token_ids[0]."""
        acc = self._acc.get(sr.request_id)
        if acc is None:
            acc = self._acc[sr.request_id] = _Acc(sr.prompt_len)
        end = sr.start + len(sr.token_ids)
        # Position p scores p + 1: the chunk's own tokens, then the next chunk's first
        # (a known prompt token in all_token_ids).
        last = min(end if len(sr.all_token_ids) > end else end - 1, acc.prompt_len - 1)
        lo = max(sr.start, acc.next_target - 1)
        if lo >= last or lo > acc.next_target - 1:
            return None  # nothing new; or positions never computed here (KV from elsewhere)
        rows = [first_row + p - sr.start for p in range(lo, last)]
        targets = [sr.token_ids[p + 1 - sr.start] if p + 1 < end else sr.all_token_ids[p + 1]
                   for p in range(lo, last)]
        return rows, targets

    def record(self, chunks: Sequence[tuple[ScheduledRequest, list[int], list[int]]],
               logits: torch.Tensor) -> None:
        """``logits``: one row per entry of the chunks' rows, in order. Their number is
        bounded by the step's token budget (max_num_batched_tokens); the log-softmax
        runs over slices of them, so it adds little to that."""
        at = 0
        for sr, rows, targets in chunks:
            acc = self._acc[sr.request_id]
            n = sr.params.prompt_logprobs or 0
            for lo in range(0, len(rows), _SLICE):
                hi = min(lo + _SLICE, len(rows))
                sub = torch.log_softmax(logits[at + lo:at + hi].float(), dim=-1)
                ids = torch.tensor(targets[lo:hi], dtype=torch.long, device=sub.device)
                chosen = sub.gather(1, ids[:, None])
                ranks = ((sub > chosen).sum(dim=-1) + 1).tolist()
                top = sub.topk(max(n, 1), dim=-1)
                top_v, top_i = top.values.tolist(), top.indices.tolist()
                for j, v in enumerate(chosen[:, 0].tolist()):
                    pairs = list(zip(top_i[j][:n], top_v[j][:n], strict=True))
                    acc.items.append(TokenLogprobs(v, pairs, int(ranks[j])))
            at += len(rows)
            acc.next_target += len(rows)

    def take(self, request_id: str) -> list[TokenLogprobs] | None:
        """The whole list once every prompt token is scored, the first time only."""
        acc = self._acc.get(request_id)
        if acc is None or acc.taken or acc.next_target < acc.prompt_len:
            return None
        acc.taken = True
        items, acc.items = acc.items, []
        return items

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)
