"""The model runner under the engine core: chunked prefill, mixed batches, async
scheduling (PLACEHOLDER) and preemption give the same greedy tokens as one request
alone; a bad block table is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.config import SchedulerConfig
from kvrelay.core.engine import Engine
from kvrelay.core.runner import Batch, ScheduledRequest
from kvrelay.model import load_model
from kvrelay.model.loader import Model
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.models import write_tiny_hf_model

PROMPTS = [[5 + (i * 7 + j * 3) % 300 for j in range(10 + 9 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("m") / "llama", seed=2)


def _generate(
    model: Model, cfg: SchedulerConfig, params: SamplingParams
) -> tuple[dict[str, list[int]], int]:
    engine = Engine(cfg, model.runner)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out, engine.scheduler.num_preemptions


@pytest.mark.parametrize(
    "budget,async_sched,num_blocks",
    [(8, False, 64), (13, True, 64), (512, True, 64), (16, False, 16)],
)
def test_batching_does_not_change_greedy_tokens(
    model_dir: Path, budget: int, async_sched: bool, num_blocks: int
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = {}
    for i, p in enumerate(PROMPTS):
        m = load_model(str(model_dir), block_size=4, num_blocks=64)
        engine = Engine(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=512), m.runner)
        engine.add_request("x", p, params)
        toks: list[int] = []
        while engine.has_work():
            for o in engine.step():
                toks += o.new_token_ids
        alone[f"r{i}"] = toks
    m = load_model(str(model_dir), block_size=4, num_blocks=num_blocks)
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_model_len=512,
        async_scheduling=async_sched,
    )
    out, preemptions = _generate(m, cfg, params)
    assert out == alone
    assert (preemptions > 0) == (num_blocks < 64)


def test_too_few_blocks_is_refused(model_dir: Path) -> None:
    m = load_model(str(model_dir), block_size=4, num_blocks=8)
    sr = ScheduledRequest("a", list(range(3, 12)), 0, [0, 1], True, SamplingParams(), 9)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        m.runner.execute(Batch(0, [sr]))


def test_kv_cache_geometry_and_factory(model_dir: Path) -> None:
    made = []

    def factory(shape: tuple[int, ...], dtype: object) -> object:
        import torch

        t = torch.full(shape, 0.0, dtype=dtype)  # type: ignore[arg-type]
        made.append(t)
        return t

    m = load_model(str(model_dir), block_size=8, num_blocks=5, kv_cache_factory=factory)  # type: ignore[arg-type]
    assert m.kv_cache is made[0]
    assert tuple(m.kv_cache.shape) == (5, 2, 2, 8, 2, 16)
    g = m.kv_geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size, g.layout) == (
        2,
        2,
        16,
        8,
        "block_major",
    )
    assert g.block_bytes == m.kv_cache[0].numel() * 4
    mem = load_model(str(model_dir), block_size=8, kv_cache_memory_gb=g.block_bytes * 7 / 2**30)
    assert mem.num_blocks == 7


def test_clear_errors(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ValueError, match=r"gpt_neox.*supported: llama, mistral, qwen2"):
        load_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(str(model_dir), dtype="int8")


def test_bfloat16_is_close_to_float32(model_dir: Path) -> None:
    import torch

    logits = {}
    for dtype in ("float32", "bfloat16"):
        m = load_model(str(model_dir), dtype=dtype, block_size=4, num_blocks=16)
        assert m.kv_cache.dtype == getattr(torch, dtype)
        sr = ScheduledRequest("a", PROMPTS[2], 0, list(range(8)), True, SamplingParams(), 28)
        logits[dtype] = m.runner.compute_logits(Batch(0, [sr]))[1][0]
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.1, rtol=0.05)


def test_unsupported_gguf_tensor_type_is_named(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "f64.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"token_embd.weight has quantization type F64.*Q4_1"):
        load_model(str(path))


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    from kvrelay.testing.models import (
        tiny_hf_config,
        tiny_tokenizer_json,
        tiny_weights,
        write_hf_dir,
    )

    cfg = tiny_hf_config("mistral", 384)
    cfg["sliding_window"] = 64
    path = write_hf_dir(tmp_path / "m", cfg, tiny_weights(cfg, 0), tiny_tokenizer_json())
    assert load_model(str(path), num_blocks=4).max_model_len == 64


def test_sharded_safetensors_and_chat_template_file(tmp_path: Path, model_dir: Path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shard_dir = tmp_path / "sharded"
    shutil.copytree(model_dir, shard_dir)
    state = load_file(str(shard_dir / "model.safetensors"))
    (shard_dir / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    save_file(
        {n: state[n] for n in names[:half]}, str(shard_dir / "model-00001-of-00002.safetensors")
    )
    save_file(
        {n: state[n] for n in names[half:]}, str(shard_dir / "model-00002-of-00002.safetensors")
    )
    tcfg = json.loads((shard_dir / "tokenizer_config.json").read_text())
    del tcfg["chat_template"]
    (shard_dir / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (shard_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    a = load_model(str(model_dir), block_size=4, num_blocks=8)
    b = load_model(str(shard_dir), block_size=4, num_blocks=8)
    assert b.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    sr = ScheduledRequest("a", PROMPTS[0], 0, [0, 1, 2, 3, 4], True, SamplingParams(), 10)
    import torch

    la = a.runner.compute_logits(Batch(0, [sr]))[1]
    lb = b.runner.compute_logits(Batch(0, [sr]))[1]
    assert torch.equal(la, lb)
