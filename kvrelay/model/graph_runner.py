"""The decode graphs bound to a model: the eager step they capture, the CUDA capture,
and switching them on for a runner (graphs.py holds the bookkeeping).

Nothing here needs CUDA or a recent torch at import: ``torch.cuda.CUDAGraph``,
``graph_pool_handle`` and ``graph`` are touched only when a capture function is made
for a CUDA device (they exist in every torch since 1.10).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrelay.model.kernels.backend import GraphableBackend, KernelBackend, supports_graphs
from kvrelay.model.kernels.graphs import (
    Capture,
    DecodeGraphs,
    DecodeInputs,
    GraphHandle,
    batch_buckets,
)
from kvrelay.model.model import LlamaModel
from kvrelay.model.runner import ModelRunner


def graphs_wanted(device: torch.device, enforce_eager: bool, backend: KernelBackend) -> bool:
    """Decode graphs run on CUDA devices only, unless ``--enforce-eager``, and only
    with a backend that can be captured (the torch one; native kernels are CPU-only)."""
    return device.type == "cuda" and not enforce_eager and supports_graphs(backend)


def decode_step(
    model: LlamaModel, kv_cache: torch.Tensor, block_size: int
) -> Callable[[DecodeInputs], torch.Tensor]:
    """The eager decode step over static inputs: metadata and forward, device ops only."""
    if not supports_graphs(model.backend):
        raise ValueError(f"kernel backend {model.backend.name!r} cannot be captured in a graph")
    backend: GraphableBackend = model.backend  # type: ignore[assignment]

    def step(x: DecodeInputs) -> torch.Tensor:
        meta = backend.static_decode_metadata(
            x.positions, x.block_tables, x.context_lens, x.slot_mapping, block_size
        )
        return model.forward(x.input_ids, kv_cache, meta, x.logit_rows)

    return step


def cuda_capture(device: torch.device) -> Capture:
    """Captures into CUDA graphs that share one memory pool (graphs.py says why that
    is safe). Each capture first runs the step once on a side stream, outside the
    graph, so lazy initialisation (cuBLAS handles and workspaces) is not recorded."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[GraphHandle, torch.Tensor]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a relay thread of this engine may touch CUDA (a KV copy into
        # other blocks) while the engine thread captures.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    return capture


def enable_decode_graphs(
    runner: ModelRunner,
    *,
    max_num_seqs: int,
    max_len: int,
    scratch_block: int,
    capture: Capture,
) -> DecodeGraphs:
    """Decode steps of ``runner`` go through graphs from now on. ``scratch_block``: a
    block of the runner's cache that no pool hands out (padded rows write there)."""
    blocks = runner.kv_cache.shape[0]
    if not 0 <= scratch_block < blocks:
        raise ValueError(f"scratch block {scratch_block} is outside the cache's {blocks} blocks")
    bs = runner.block_size
    graphs = DecodeGraphs(
        decode_step(runner.model, runner.kv_cache, bs),
        capture,
        batch_sizes=batch_buckets(max_num_seqs),
        max_blocks=-(-max_len // bs),
        block_size=bs,
        scratch_block=scratch_block,
        vocab_size=runner.model.lm_head.weight.shape[0],
        device=runner.device,
    )
    runner.graphs = graphs
    return graphs
