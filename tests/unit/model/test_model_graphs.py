"""Decode graphs (kvrelay/model/kernels/graphs.py): the bucket choice at its edges, and on CPU,
with a stand-in graph that records captures and replays by re-running the eager
step on the static buffers, a real tiny model's padded decode step gives the eager
step's logits for the real rows, padded rows touch only the scratch block, a batch
above the largest bucket runs eagerly, and greedy generation through the engine is
unchanged. The CUDA test at the end runs real graphs where a GPU is present."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.runner import Batch, ScheduledRequest
from kvrelay.model import load_model
from kvrelay.model.graph_runner import enable_decode_graphs, graphs_wanted
from kvrelay.model.kernels.graphs import (
    DecodeGraphs,
    GraphHandle,
    RerunGraph,
    batch_buckets,
    width_buckets,
)
from kvrelay.model.loader import Model
from kvrelay.model.runner import ModelRunner
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.models import write_tiny_hf_model

BS = 4  # tokens per block
BLOCKS = 96  # blocks the pool owns; the graph cache has one more, the scratch block


def test_batch_buckets_are_vllms_sizes_up_to_max_num_seqs() -> None:
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(256)[-2:] == [248, 256]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    assert batch_buckets(4096)[-1] == 512
    assert width_buckets(16) == [1, 2, 4, 8, 16]
    assert width_buckets(10) == [1, 2, 4, 8, 10]
    assert width_buckets(1) == [1]
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


def _plain_graphs(max_num_seqs: int, max_blocks: int) -> DecodeGraphs:
    return DecodeGraphs(lambda x: x.input_ids.float(), lambda fn: (RerunGraph(fn, fn()), fn()),
                        batch_sizes=batch_buckets(max_num_seqs), max_blocks=max_blocks,
                        block_size=BS, scratch_block=7, vocab_size=1,
                        device=torch.device("cpu"))


@given(st.integers(1, 300), st.integers(1, 40))
def test_bucket_is_the_smallest_that_holds_the_batch(max_num_seqs: int, n: int) -> None:
    g = _plain_graphs(max_num_seqs, 8)
    sizes = batch_buckets(max_num_seqs)
    b = g.batch_bucket(n)
    if n > sizes[-1]:
        assert b is None
    else:
        assert b is not None and b >= n and all(s < n for s in sizes if s < b)


def test_padding_at_the_edges() -> None:
    g = _plain_graphs(10, 8)
    assert [g.batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 10, 11)] == [
        1, 2, 4, 4, 8, 8, 10, 10, None]
    # Position 3 is the last of block 0 (1 block); 4 starts block 1 (2 blocks).
    step = g.pad([11, 12, 13], [3, 4, 31], [[5], [2, 3], [0, 1, 2, 3, 4, 5, 6, 8]])
    assert step is not None and (step.bucket, step.width) == (4, 8)
    assert step.rows.tolist() == [[11, 12, 13, 0], [3, 4, 31, 0], [4, 5, 32, 1],
                                  [5 * BS + 3, 3 * BS + 0, 8 * BS + 3, 7 * BS]]
    assert step.tables[1].tolist() == [2, 3, 7, 7, 7, 7, 7, 7]
    assert step.tables[3].tolist() == [7] * 8
    assert g.pad([1], [32], [list(range(9))]) is None  # 9 blocks > the 8 a sequence may have
    assert g.pad(list(range(11)), [0] * 11, [[0]] * 11) is None


class Recorder:
    """The test's fake capture: a RerunGraph per capture, every call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[GraphHandle, torch.Tensor]:
        out = fn()  # the warm-up run
        out.fill_(torch.nan)  # as on CUDA, capturing computes nothing: replay must
        self.calls.append(("capture", out.shape[0]))
        calls = self.calls

        class Graph(RerunGraph):
            def replay(self) -> None:
                calls.append(("replay", self.out.shape[0]))
                super().replay()

        return Graph(fn, out), out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = write_tiny_hf_model(tmp_path_factory.mktemp("g") / "llama", seed=5)
    with pytest.MonkeyPatch.context() as mp:  # the backend CUDA runs: torch ops
        mp.setenv("KVRELAY_KERNELS", "torch")
        return load_model(str(path), block_size=BS, num_blocks=BLOCKS)


def _runners(model: Model, max_num_seqs: int) -> tuple[ModelRunner, ModelRunner, Recorder]:
    """An eager runner and a graph runner over equal caches (random KV: any context
    will do), the graph one with the scratch block at index BLOCKS."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(BLOCKS + 1, *model.kv_cache.shape[1:], generator=gen)
    eager = ModelRunner(model.runner.model, cache[:BLOCKS].clone(), BS)  # type: ignore[attr-defined]
    graph = ModelRunner(model.runner.model, cache, BS)  # type: ignore[attr-defined]
    rec = Recorder()
    enable_decode_graphs(graph, max_num_seqs=max_num_seqs, max_len=model.max_model_len,
                         scratch_block=BLOCKS, capture=rec)
    return eager, graph, rec


def _decode_batch(rng: random.Random, n: int) -> Batch:
    """n decode rows with ragged contexts on disjoint random blocks."""
    free = list(range(BLOCKS))
    rng.shuffle(free)
    reqs = []
    for i in range(n):
        pos = rng.randrange(0, 10 * BS)
        table = [free.pop() for _ in range(pos // BS + 1 + rng.randrange(2))]
        reqs.append(ScheduledRequest(f"r{i}", [rng.randrange(3, 300)], pos, table, True,
                                     SamplingParams(), pos))
    return Batch(0, reqs)


def _write_slots(batch: Batch) -> set[tuple[int, int]]:
    return {(sr.block_ids[sr.start // BS], sr.start % BS) for sr in batch.requests}


@pytest.mark.parametrize("n", [1, 3, 5, 9, 12])
def test_padded_graph_step_equals_the_eager_step(model: Model, n: int) -> None:
    eager, graph, rec = _runners(model, max_num_seqs=12)
    batch = _decode_batch(random.Random(n), n)
    before = graph.kv_cache.clone()
    _, want = eager.compute_logits(batch)
    _, got = graph.compute_logits(batch)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graph.graphs is not None and graph.graphs.replays == 1
    bucket = graph.graphs.batch_bucket(n)
    assert rec.calls == [("capture", bucket), ("replay", bucket)]
    # Slots (block, offset) the step changed in any layer: the real rows' own, and
    # the scratch block's when there were padded rows; no other block.
    changed = (graph.kv_cache != before).any(dim=(1, 2, 4, 5)).nonzero().tolist()
    real = {(b, o) for b, o in changed if b != BLOCKS}
    assert real == _write_slots(batch)
    assert any(b == BLOCKS for b, _ in changed) == (bucket != n)
    torch.testing.assert_close(graph.kv_cache[:BLOCKS], eager.kv_cache, rtol=1e-4, atol=1e-4)


def test_captures_once_per_bucket_and_runs_large_batches_eagerly(model: Model) -> None:
    eager, graph, rec = _runners(model, max_num_seqs=4)
    g = graph.graphs
    assert g is not None
    rng = random.Random(7)
    for n in (3, 4, 2, 3, 6):
        batch = _decode_batch(rng, n)
        _, want = eager.compute_logits(batch)
        _, got = graph.compute_logits(batch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [c for c in rec.calls if c[0] == "capture"] == [
        ("capture", b) for b, _ in sorted(set(g.captured), key=list(g._graphs).index)]
    assert g.replays == 4 and g.eager_steps == 1  # the batch of 6 is above bucket 4
    assert {b for b, _ in g.captured} == {2, 4}
    # A prefill step never reaches the graphs.
    sr = ScheduledRequest("p", [5, 6, 7], 0, [0], True, SamplingParams(), 3)
    graph.compute_logits(Batch(1, [sr]))
    assert g.replays == 4 and g.eager_steps == 1


PROMPTS = [[5 + (i * 7 + j * 3) % 300 for j in range(3 + 5 * i)] for i in range(6)]


def _generate(runner: ModelRunner, max_num_seqs: int) -> dict[str, list[int]]:
    engine = Engine(SchedulerConfig(num_blocks=BLOCKS, block_size=BS, max_model_len=512,
                                    max_num_seqs=max_num_seqs), runner)
    for i, p in enumerate(PROMPTS):  # different lengths: the batch shrinks as they end
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4 + 3 * i,
                                                      ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_greedy_generation_through_graphs_is_unchanged(model: Model) -> None:
    eager, graph, _ = _runners(model, max_num_seqs=6)
    assert _generate(graph, 6) == _generate(eager, 6)
    assert graph.graphs is not None and graph.graphs.replays > 10
    assert len({b for b, _ in graph.graphs.captured}) >= 3


def test_graphs_only_on_cuda_without_enforce_eager(model: Model) -> None:
    assert model.runner.graphs is None  # type: ignore[attr-defined]
    assert model.kv_cache.shape[0] == model.num_blocks == BLOCKS
    torch_backend = model.runner.model.backend  # type: ignore[attr-defined]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted(cuda, False, torch_backend)
    assert not graphs_wanted(cuda, True, torch_backend)
    assert not graphs_wanted(cpu, False, torch_backend)
    native = type("Native", (), {"name": "native"})()  # no static_decode_metadata
    assert not graphs_wanted(cuda, False, native)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    path = str(write_tiny_hf_model(tmp_path / "llama", seed=5))
    runs = {}
    for eager in (True, False):
        m = load_model(path, block_size=BS, num_blocks=BLOCKS, device="cuda",
                       max_num_seqs=6, enforce_eager=eager)
        runner: ModelRunner = m.runner  # type: ignore[assignment]
        assert m.num_blocks == BLOCKS and m.kv_cache.shape[0] == BLOCKS + (not eager)
        assert (runner.graphs is None) == eager
        runs[eager] = _generate(runner, 6)
        if not eager:
            assert runner.graphs is not None and runner.graphs.replays > 10
    assert runs[False] == runs[True]
