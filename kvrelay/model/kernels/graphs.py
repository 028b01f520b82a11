"""CUDA graphs for decode steps: the bookkeeping, pure and device-free.

A decode step (every request computes one token) launches a few hundred small
kernels; on a GPU its time is the launches and the Python around them, whatever
the model size (issue 11: ~30 ms a step). A CUDA graph records the launches once
and replays them with one call, as vLLM's CUDA graph runner does:

- Graphs exist per (batch bucket, width bucket). Batch buckets are 1, 2, 4, 8, 16,
  24, ... up to ``max_num_seqs`` (vLLM's sizes); a batch is padded up to the next
  bucket and one above the largest runs eagerly. The width is the block-table
  columns the step attends over, a power of two (or the per-sequence maximum): the
  torch attention gathers ``width * block_size`` positions per row, so one width for
  all contexts would make a 10-token step pay for ``max_model_len``.
- A graph reads its inputs from static buffers (input ids, positions, context
  lengths and slot mappings in one (4, max batch) tensor, block tables in a (max
  batch, max blocks per sequence) tensor) that each step copies into; a graph for
  (b, w) reads the views ``[:b]`` and ``[:b, :w]``.
- Padded rows are token 0 at position 0 with context 1, block table all
  ``scratch_block``, slot ``scratch_block * block_size``: they write their KV into
  the scratch block and read only it, never a real block. The scratch block is a
  block of the cache that the pool never sees (the loader allocates one block more
  than it reports, see loader.py). Their logits are dropped.
- Graphs are captured lazily, the first time a (b, w) is needed, into one memory
  pool; a capture happens once per key, every later step with that key replays.
  Sharing the pool is safe because steps run one at a time. Every graph copies its
  logits into one static (max batch, vocab) buffer, consumed (sampled) before the
  next replay overwrites it.

The capture function and the eager step are arguments, so on CPU the tests run
this with a stand-in graph (``RerunGraph``) and a real model forward.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger("kvrelay.model")

LARGEST_BUCKET = 512  # vLLM's default largest capture size


class GraphHandle(Protocol):
    def replay(self) -> None: ...


# capture(fn) -> (graph, out): records fn's work; ``out`` is the tensor fn returned,
# which every replay of the graph rewrites. Capture may also run fn (a warm-up), so
# fn must be idempotent: a decode step rewrites the same KV slots with the same values.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[GraphHandle, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """Views of the static buffers for one (batch, width) bucket."""

    input_ids: torch.Tensor  # (B,) long
    positions: torch.Tensor  # (B,) long
    context_lens: torch.Tensor  # (B,) long: position + 1
    slot_mapping: torch.Tensor  # (B,) long: block * block_size + offset
    block_tables: torch.Tensor  # (B, W) long
    logit_rows: torch.Tensor  # (B,) long: 0 .. B-1


StepFn = Callable[[DecodeInputs], torch.Tensor]  # the eager step: (B, vocab) logits


def batch_buckets(max_num_seqs: int, largest: int = LARGEST_BUCKET) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to ``min(max_num_seqs, largest)``, which
    is itself a bucket."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return [*sizes, top]


def width_buckets(max_blocks: int) -> list[int]:
    """Powers of two below ``max_blocks``, then ``max_blocks``."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return [*widths, max_blocks]


def _bucket(buckets: Sequence[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class RerunGraph:
    """The graph contract without a graph: replay re-runs the function into the
    captured output. For CPU (tests, the device check's dry run), where CUDA graphs
    do not exist; it exercises every piece of the bookkeeping but saves nothing."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn = fn
        self.out = out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def rerun_capture(fn: Callable[[], torch.Tensor]) -> tuple[GraphHandle, torch.Tensor]:
    out = fn()
    return RerunGraph(fn, out), out


@dataclass(frozen=True, slots=True)
class PaddedStep:
    """A decode step padded to its buckets, on the host, ready to copy in."""

    batch: int  # real rows
    bucket: int
    width: int
    rows: torch.Tensor  # (4, bucket) long: input ids, positions, context lens, slots
    tables: torch.Tensor  # (bucket, width) long


class DecodeGraphs:
    """Which graphs exist, which one a decode step goes to, its padded inputs, when
    to capture and what to replay (the module docstring says how)."""

    def __init__(
        self,
        step: StepFn,
        capture: Capture,
        *,
        batch_sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if list(batch_sizes) != sorted(set(batch_sizes)) or not batch_sizes or batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be increasing positive sizes, got {batch_sizes}")
        self.step = step
        self.capture = capture
        self.batch_sizes = list(batch_sizes)
        self.widths = width_buckets(max_blocks)
        self.block_size = block_size
        self.scratch_block = scratch_block
        n, w = self.batch_sizes[-1], self.widths[-1]
        self._rows = torch.zeros(4, n, dtype=torch.long, device=device)
        self._tables = torch.full((n, w), scratch_block, dtype=torch.long, device=device)
        self._logit_rows = torch.arange(n, dtype=torch.long, device=device)
        # Every graph leaves its logits here: one (max batch, vocab) buffer, not one
        # per graph (35 buckets x widths of a 256 x 49k float32 output would be GBs).
        self._logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int], tuple[GraphHandle, torch.Tensor]] = {}
        self.replays = 0
        self.eager_steps = 0  # decode steps above the largest bucket (or too wide)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def batch_bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows; None above the largest."""
        return _bucket(self.batch_sizes, n)

    def width_bucket(self, blocks: int) -> int | None:
        return _bucket(self.widths, blocks)

    def pad(
        self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> PaddedStep | None:
        """The step's inputs padded to its buckets; None when it must run eagerly."""
        n, bs = len(token_ids), self.block_size
        b = self.batch_bucket(n)
        w = self.width_bucket(max(positions) // bs + 1) if n else None
        if b is None or w is None:
            return None
        pad = b - n
        scratch = self.scratch_block
        # array('q') then one frombuffer: 3x faster than torch.tensor of nested lists
        # (250 rows x 16 blocks: 0.4 ms against 1.2 ms on the dev machine's CPU).
        rows = array("q", token_ids)
        rows.extend([0] * pad)
        rows.extend(positions)
        rows.extend([0] * pad)
        rows.extend([p + 1 for p in positions])
        rows.extend([1] * pad)
        rows.extend([t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)])
        rows.extend([scratch * bs] * pad)
        grid = array("q")
        for t in tables:
            row = t[:w]
            grid.extend(row)
            if len(row) < w:
                grid.extend([scratch] * (w - len(row)))
        grid.extend([scratch] * (w * pad))
        return PaddedStep(n, b, w, torch.frombuffer(rows, dtype=torch.long).view(4, b),
                          torch.frombuffer(grid, dtype=torch.long).view(b, w))

    def inputs(self, b: int, w: int) -> DecodeInputs:
        r = self._rows
        return DecodeInputs(
            r[0, :b], r[1, :b], r[2, :b], r[3, :b], self._tables[:b, :w], self._logit_rows[:b]
        )

    def run(
        self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor | None:
        """Logits (len(token_ids), vocab) of a decode step through its graph (captured
        now if new), or None: run it eagerly. The result is a view of the graph's
        output, valid until the next step."""
        step = self.pad(token_ids, positions, tables)
        if step is None:
            self.eager_steps += 1
            return None
        b, w = step.bucket, step.width
        self._rows[:, :b].copy_(step.rows, non_blocking=True)
        self._tables[:b, :w].copy_(step.tables, non_blocking=True)
        key = (b, w)
        entry = self._graphs.get(key)
        if entry is None:
            x, out = self.inputs(b, w), self._logits[:b]
            entry = self.capture(lambda: out.copy_(self.step(x)))
            self._graphs[key] = entry
            log.info("captured a decode graph for batch %d, %d blocks per sequence", b, w)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out[: step.batch]
