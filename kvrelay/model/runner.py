"""The model runner: one engine step on the real model (implements core.runner.Runner).

On a CUDA device ``execute`` returns once the step's kernels are queued: without any
synchronisation when no row samples (a step of middle chunks of a chunked prefill).
So every step's ``batch.completion`` is an event recorded after everything the step
queued, also when it raised; the engine frees none of the step's blocks (abort,
preemption, hand-off to a lease) before the event completes. On the CPU the work is
done when ``execute`` returns and the batch keeps ``COMPLETE``.
"""

from __future__ import annotations

import torch

from kvrelay.core.runner import (
    COMPLETE,
    PLACEHOLDER,
    Batch,
    SampledToken,
    ScheduledRequest,
    StepToken,
)
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.kernels.graphs import DecodeGraphs
from kvrelay.model.model import LlamaModel
from kvrelay.model.sampling.sampler import Sampler
from kvrelay.sampling_params import SamplingParams


class CudaStepDone:
    """A step's completion token: an event recorded on the current (compute) stream."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, *, seed: int = 0
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self._cuda = self.device.type == "cuda"
        self.sampler = Sampler(seed)
        # The token sampled for each request in its latest step: resolves PLACEHOLDER.
        self._last: dict[str, int] = {}
        # Decode steps replay CUDA graphs when set (graph_runner.enable_decode_graphs).
        self.graphs: DecodeGraphs | None = None

    def execute(self, batch: Batch) -> dict[str, SampledToken]:
        try:
            return self._execute(batch)
        finally:
            batch.completion = self.step_token()

    def step_token(self) -> StepToken:
        """Done once everything queued on the device so far is: an event on CUDA; on
        the CPU the work is done when ``execute`` returns."""
        return CudaStepDone() if self._cuda else COMPLETE

    @torch.inference_mode()
    def _execute(self, batch: Batch) -> dict[str, SampledToken]:
        for rid in batch.finished_ids:
            self._last.pop(rid, None)
            self.sampler.forget(rid)
        if not batch.requests:
            return {}
        sampled, logits = self.compute_logits(batch)
        self.sampler.observe(batch.requests, self._resolve)  # before _last changes
        if not sampled:
            return {}
        params: list[SamplingParams] = [sr.params for sr in sampled]
        new_pos = [sr.start + len(sr.token_ids) for sr in sampled]
        rids = [sr.request_id for sr in sampled]
        tokens = self.sampler.sample(logits, params, new_pos, rids)
        out: dict[str, SampledToken] = {}
        for sr, tok in zip(sampled, tokens, strict=True):
            self._last[sr.request_id] = tok.token_id
            out[sr.request_id] = tok
        return out

    @torch.inference_mode()
    def compute_logits(self, batch: Batch) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run the batch's forward pass (writing its KV); return the requests with
        ``sample`` set and their float32 logits, one row each, in batch order."""
        token_ids: list[int] = []
        positions: list[int] = []
        chunks: list[ChunkSpec] = []
        logit_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        # prompt_logprobs: (request, rows of the chunk's prompt positions, their targets)
        prompt_rows: list[tuple[ScheduledRequest, list[int], list[int]]] = []
        for sr in batch.requests:
            end = sr.start + len(sr.token_ids)
            if len(sr.block_ids) * self.block_size < end:
                raise ValueError(
                    f"request {sr.request_id}: {len(sr.block_ids)} blocks of {self.block_size} "
                    f"cannot hold {end} tokens"
                )
            first_row = len(token_ids)
            token_ids.extend(self._resolve(sr))
            positions.extend(range(sr.start, end))
            chunks.append(ChunkSpec(sr.start, len(sr.token_ids), sr.block_ids))
            if sr.sample:
                logit_rows.append(len(token_ids) - 1)
                sampled.append(sr)
            if sr.params.prompt_logprobs is not None:
                rows = self.sampler.prompt.rows(sr, first_row)
                if rows is not None:
                    prompt_rows.append((sr, *rows))
        if (self.graphs is not None and not prompt_rows
                and len(token_ids) == len(sampled) == len(batch.requests)):
            tables = [sr.block_ids for sr in batch.requests]
            logits = self.graphs.run(token_ids, positions, tables)
            if logits is not None:
                return sampled, logits
        extra = [r for _, rows, _ in prompt_rows for r in rows]
        logits = self._forward(token_ids, positions, chunks, logit_rows + extra)
        if prompt_rows:
            self.sampler.prompt.record(prompt_rows, logits[len(logit_rows):])
        return sampled, logits[: len(logit_rows)]

    def _resolve(self, sr: ScheduledRequest) -> list[int]:
        if PLACEHOLDER not in sr.token_ids:
            return sr.token_ids
        last = self._last.get(sr.request_id)
        if last is None:
            raise ValueError(f"request {sr.request_id}: placeholder with no previous sample")
        return [last if t == PLACEHOLDER else t for t in sr.token_ids]

    def _forward(
        self,
        token_ids: list[int],
        positions: list[int],
        chunks: list[ChunkSpec],
        logit_rows: list[int],
    ) -> torch.Tensor:
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        meta = self.model.build_metadata(chunks, pos, self.block_size)
        return self.model.forward(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            self.kv_cache,
            meta,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
