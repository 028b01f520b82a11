"""The native backend's per-step inputs, built once for every layer: decode rows'
block tables, prompt chunks grouped for the tiles (fresh ones by length, ones after a
cached prefix), and the chunks the AMX kernel or SDPA takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.model.kernels.prompt_route import NEVER


class NativeStep:
    """Per-step inputs of the attention kernel, built once for every layer."""

    __slots__ = ("continued", "fresh", "k_rows", "positions", "prompts", "seqs", "skip_from",
                 "skip_tokens", "tables")

    def __init__(
        self, positions: torch.Tensor, k_rows: torch.Tensor, seqs: torch.Tensor,
        tables: torch.Tensor, fresh: Sequence[FreshPrompts] = (),
        continued: Sequence[ContinuedPrompt] = (), prompts: PromptChunks | None = None,
        skip_from: int = NEVER, skip_tokens: int = NEVER,
    ) -> None:
        self.positions = positions
        self.k_rows = k_rows  # (T,) layer-0 K rows (of KVH * D values) of each token's slot
        self.seqs = seqs  # (S, 3): first token in the step, token count, first position
        self.tables = tables  # (S, W) block ids, padded with 0
        self.fresh = fresh  # prompts' first chunks whose attention SDPA computes
        self.continued = continued  # and their later chunks (after cached context)
        self.prompts = prompts  # or every prompt chunk, for the AMX kernel instead
        # the native call leaves the attention of the chunks of skip_tokens tokens or more
        # that attend to skip_from positions or more to them
        self.skip_from, self.skip_tokens = skip_from, skip_tokens


class FreshPrompts:
    """The first chunks (no cached context) of ``count`` prompts of ``length`` tokens in
    one step: their token indices in the step and the layer-0 K rows of their slots."""

    __slots__ = ("count", "k_rows", "length", "tokens")

    def __init__(self, length: int, tokens: list[int], k_rows: list[int]) -> None:
        self.length, self.count = length, len(tokens) // length
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.k_rows = torch.tensor(k_rows, dtype=torch.long)


def _slots(table: Sequence[int], positions: range, block_size: int,
           block_rows: int) -> list[int]:
    """The layer-0 K rows of the slots of ``positions`` in a sequence's block table."""
    return [table[p // block_size] * block_rows + p % block_size for p in positions]


CONTINUED_ROWS = 256


class ContinuedPrompt:
    """A prompt chunk of ``length`` tokens (token indices from ``first`` in the step) after
    ``start`` positions of cached context: its queries attend to the layer-0 K rows
    ``k_rows``, every position up to its last."""

    __slots__ = ("first", "k_rows", "length", "start")

    def __init__(self, first: int, start: int, length: int, k_rows: list[int]) -> None:
        self.first, self.start, self.length = first, start, length
        self.k_rows = torch.tensor(k_rows, dtype=torch.long)


class PromptChunks:
    """Prompt chunks (first chunks and chunks after cached context) whose attention the
    AMX kernel computes (csrc/attn_prefill_amx.cpp): ``chunks`` (P, 4) holds each one's
    first token in the step, cached positions before it, token count and where its keys'
    layer-0 K rows (every position up to its last) begin in ``k_rows``."""

    __slots__ = ("chunks", "k_rows")

    def __init__(self, chunks: list[tuple[int, int, int, int]], k_rows: list[int]) -> None:
        self.chunks = torch.tensor(chunks, dtype=torch.long).view(-1, 4)
        self.k_rows = torch.tensor(k_rows, dtype=torch.long)
