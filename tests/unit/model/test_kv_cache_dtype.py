"""``kv_cache_dtype`` (``--kv-cache-dtype``): a bfloat16 KV cache under a float32 model."""

from __future__ import annotations

import pytest
import torch

from kvrelay.model.kernels import ext
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.llm import LLM
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.models import write_tiny_gguf

KERNELS = ["torch"] + (["native"] if ext.load() is not None else [])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kvdt") / "tiny.gguf", seed=4))


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_bfloat16_cache_holds_half_the_bytes_and_the_logits_stay_close(
    tiny: str, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is bfloat16, its blocks half the bytes (twice the blocks in the same
    memory), its geometry (what engines compare before exchanging KV) differs from the
    float32 cache's; the logits of 24 positions, prefill then decode steps over the
    rounded K/V, stay within bfloat16 rounding of the float32 cache's."""
    monkeypatch.setenv("KVRELAY_KERNELS", kernels)
    llms = {kv: LLM(tiny, dtype="float32", kv_cache_dtype=kv, quantization="none",
                    kv_cache_memory_gb=0.001) for kv in ("auto", "bfloat16")}
    f32, bf16 = llms["auto"].model, llms["bfloat16"].model
    assert f32.kv_cache.dtype is torch.float32 and bf16.kv_cache.dtype is torch.bfloat16
    assert f32.dtype == bf16.dtype == "float32"
    assert bf16.kv_geometry.dtype == "bfloat16"
    assert bf16.kv_geometry.block_bytes * 2 == f32.kv_geometry.block_bytes
    assert bf16.num_blocks == 2 * f32.num_blocks
    assert bf16.kv_geometry.compat_hash("m") != f32.kv_geometry.compat_hash("m")
    ids = list(range(40, 64))
    logits = {}
    for kv, llm in llms.items():
        runner = llm.model.runner  # type: ignore[attr-defined]
        blocks = list(range(-(-len(ids) // runner.block_size)))
        # a 16-token prefill, then 8 one-token steps reading the cache
        out = [runner._forward(ids[:16], list(range(16)), [ChunkSpec(0, 16, blocks)],
                               list(range(16)))]
        for p in range(16, len(ids)):
            out.append(runner._forward([ids[p]], [p], [ChunkSpec(p, 1, blocks)], [0]))
        logits[kv] = torch.cat(out)
    diff = (logits["bfloat16"] - logits["auto"]).abs().mean() / logits["auto"].abs().mean()
    assert 0 < diff < 0.01, diff
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llms["bfloat16"].generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4


def test_kv_cache_dtypes_that_are_refused(tiny: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported; "
                                         "supported: auto, float32, bfloat16, fp8, fp8_e4m3"):
        LLM(tiny, dtype="float32", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="under dtype 'bfloat16' is not supported"):
        LLM(tiny, dtype="bfloat16", kv_cache_dtype="float32")
    # the model's own dtype, named, is the same as auto
    model = LLM(tiny, dtype="float32", kv_cache_dtype="float32", num_blocks=8).model
    assert model.kv_cache.dtype is torch.float32


def test_generate_takes_the_flag(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay.cli import main

    assert main(["generate", "--model", tiny, "--dtype", "float32", "--kv-cache-dtype",
                 "bfloat16", "--max-tokens", "3", "hi"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", tiny, "--kv-cache-dtype", "fp8_e5m2", "hi"])
    assert e.value.code == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_the_compat_hash_tells_the_models_dtype_apart() -> None:
    """A bfloat16 cache of a float32 model and that of a bfloat16 model hold the same
    bytes but not the same KV: engines must not exchange them. Where the cache takes
    the model's dtype the hash is what it was before the field existed."""
    from kvrelay.relay.geometry import KvGeometry

    def geom(dtype: str, model_dtype: str = "") -> KvGeometry:
        return KvGeometry(architecture="llama", num_layers=2, num_kv_heads=2, head_dim=16,
                          block_size=4, dtype=dtype, model_dtype=model_dtype)

    plain = geom("bfloat16").compat_hash("m")
    assert geom("bfloat16", "bfloat16").compat_hash("m") == plain
    assert geom("bfloat16", "float32").compat_hash("m") != plain
    assert geom("float32", "float32").compat_hash("m") == geom("float32").compat_hash("m")


def test_the_compat_hash_is_unchanged_for_the_dtypes_before_fp8() -> None:
    """Engines of this version and the one before fp8 still exchange KV: the hashes of
    the default model's geometries, as that version computed them, pinned."""
    from kvrelay.relay.geometry import KvGeometry

    def geom(dtype: str, model_dtype: str) -> KvGeometry:
        return KvGeometry("llama", 30, 3, 64, 16, dtype, model_dtype=model_dtype)

    name = "SmolLM2-135M-Instruct"
    assert geom("float32", "").compat_hash(name) == "519fc1abd3ef9a70"
    assert geom("float32", "float32").compat_hash(name) == "519fc1abd3ef9a70"
    assert geom("bfloat16", "float32").compat_hash(name) == "755783a04a31670e"
    assert geom("bfloat16", "bfloat16").compat_hash(name) == "e60c2e5bfe91a84a"
    assert geom("bfloat16", "bfloat16").block_bytes == 368_640  # MODEL_NOTES.md
    fp8 = geom("fp8_e4m3", "bfloat16")
    assert fp8.scale_layout and fp8.compat_hash(name) not in (
        "e60c2e5bfe91a84a", geom("fp8_e4m3", "float32").compat_hash(name))
    # 30 layers x (K, V) x 16 tokens x 3 heads x (64 codes + a 2-byte scale)
    assert fp8.block_bytes == 30 * 2 * 16 * 3 * 66 == 190_080
