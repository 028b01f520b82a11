"""``--kv-cache-dtype fp8`` (fp8_e4m3): a uint8 cache of e4m3 codes with a float16 scale
per token and head after each head's codes, written and read in place by the native
kernels (every ISA path this CPU has: the ``isa`` fixture runs AVX2 and AVX-512).

The write is checked bit for bit against torch's own float8 conversion of what a float32
cache receives; the attention against float64 attention over the dequantized cache, to
float32 rounding (relative 1e-5 of the largest output; bfloat16 activations: 1e-2).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvrelay.model.config import ModelConfig
from kvrelay.model.kernels import ext
from kvrelay.model.kernels.attention import ChunkSpec
from kvrelay.model.kernels.native import NativeBackend
from kvrelay.model.kernels.rope import RotaryTable
from kvrelay.model.llm import LLM
from kvrelay.sampling_params import SamplingParams
from kvrelay.testing.models import write_tiny_gguf
from tests.unit.model.test_model_native_kernels import _attend_over_cache

_mod = ext.load()
pytestmark = pytest.mark.skipif(_mod is None, reason=f"native kernels: {ext.load_error()}")
SCALE = 2  # bytes of a head's float16 scale


def quantize(x: torch.Tensor) -> torch.Tensor:
    """(..., D) float32 -> (..., D + 2) uint8, as csrc/kernels_impl.h's f8_store_head."""
    s = (x.abs().amax(-1, keepdim=True) / 448).to(torch.float16)
    sf = s.float()
    q = torch.where(sf > 0, x / sf, 0.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], -1)


def dequantize(c: torch.Tensor) -> torch.Tensor:
    """(..., D + 2) uint8 -> (..., D) float32: codes times their head's scale."""
    D = c.shape[-1] - SCALE
    codes = c[..., :D].contiguous().view(torch.float8_e4m3fn).float()
    return codes * c[..., D:].contiguous().view(torch.float16).float()


@pytest.fixture(params=["per-head", "all-heads"])
def heads(request: pytest.FixtureRequest) -> Iterator[str]:
    """Decode tiles head by head, or one over every KV head (a long context's)."""
    assert _mod is not None
    _mod.set_whole_heads_bytes(0 if request.param == "all-heads" else 1 << 62)
    yield request.param
    _mod.set_whole_heads_bytes(-1)


def _cfg(H: int, KVH: int, D: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=H * D, intermediate_size=64,
        num_layers=2, num_heads=H, num_kv_heads=KVH, head_dim=D, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)


def _step(rng: random.Random, batch: int, bs: int, nb: int) -> list[ChunkSpec]:
    """Decode rows at ragged contexts, first prompt chunks and later ones."""
    free = list(range(nb))
    rng.shuffle(free)
    chunks = []
    for i in range(batch):
        start, length = [(rng.randint(0, 150), 1), (0, rng.randint(2, 40)),
                         (rng.randint(1, 100), rng.randint(2, 40))][i % 3]
        n = -(-(start + length) // bs)
        chunks.append(ChunkSpec(start, length, [free.pop() for _ in range(n)]))
    return chunks


def _backend(cfg: ModelConfig, dtype: torch.dtype) -> NativeBackend:
    return NativeBackend(cfg, RotaryTable(cfg, 512, dtype, torch.device("cpu")), dtype)


def _attend(backend: NativeBackend, chunks: list[ChunkSpec], cache: torch.Tensor,
            qkv: torch.Tensor, bs: int) -> torch.Tensor:
    pos = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.length)])
    out: torch.Tensor = backend.attention(qkv, cache, 1, backend.build_metadata(chunks, pos, bs))
    return out


def _fp8_backend(cfg: ModelConfig, dtype: torch.dtype) -> NativeBackend:
    b = _backend(cfg, dtype)
    b.take_fp8_cache()
    return b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 9, 3, 16, 9), (128, 8, 2, 32, 6)],
                         ids=lambda s: "d{}-h{}-kv{}-bs{}-b{}".format(*s))
def test_fp8_attention_matches_float64_over_the_dequantized_cache(
    isa: str, heads: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """A mixed step over a cache of random fp8 history: the K/V written are torch's
    float8 of what a float32 cache receives (bit for bit), and every output equals float64
    attention over the dequantized cache (its new rows included) to float32 rounding."""
    D, H, KVH, bs, batch = shape
    cfg = _cfg(H, KVH, D)
    nb = batch * -(-200 // bs) + 1
    chunks = _step(random.Random(D + batch), batch, bs, nb)
    g = torch.Generator().manual_seed(D)
    # values the model's dtype holds, so that its own cache can stand for float32's
    history = (torch.randn(nb, 2, 2, bs, KVH, D, generator=g) * 3).to(dtype).float()
    cache = quantize(history)
    qkv = torch.randn(sum(c.length for c in chunks), (H + 2 * KVH) * D, generator=g).to(dtype)
    q_rot = qkv.clone()
    out = _attend(_fp8_backend(cfg, dtype), chunks, cache, q_rot, bs)
    # what the same step writes into a cache of the model's dtype, quantized by torch
    plain = history.to(dtype)
    _attend(_backend(cfg, dtype), chunks, plain, qkv.clone(), bs)
    assert torch.equal(cache, quantize(plain.float()))
    # float64 over the dequantized cache, as the float caches' kernels are checked
    want = _attend_over_cache(cfg, chunks, q_rot, dequantize(cache), 1, bs)
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_fp8_codes_cover_every_magnitude(isa: str) -> None:
    """Zero, subnormal, halfway and saturating values: a one-token prompt writes the same
    bytes as torch's conversion (rounding to nearest even, 448 the largest)."""
    cfg = _cfg(1, 1, 64)
    v = torch.tensor([0.0, -0.0, 2.0**-9, 3 * 2.0**-10, 2.0**-6, 1.0625, 1.1875, -300.0,
                      440.0, 447.0, 448.0, 1e-12] + [0.5] * 52)
    qkv = torch.cat([torch.zeros(64), torch.zeros(64), v])[None]  # q, k, v
    cache = torch.zeros(1, 2, 2, 16, 1, 66, dtype=torch.uint8)
    _attend(_fp8_backend(cfg, torch.float32), [ChunkSpec(0, 1, [0])], cache, qkv, 16)
    assert torch.equal(cache[0, 1, 1, 0, 0], quantize(v))
    assert torch.equal(cache[0, 1, 0, 0, 0], quantize(torch.zeros(64)))  # scale 0: zeros


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kv8") / "tiny.gguf", seed=4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_cache_holds_a_quarter_of_float32_and_serves(tiny: str, dtype: str) -> None:
    """Under either model dtype: uint8 rows of head_dim codes and a 2-byte scale, so a
    block is (D + 2) / (itemsize x D) of the model dtype's bytes, more blocks in the same
    memory; the geometry's hash differs from the other caches'; a prompt decodes the same
    tokens cold, after its cached prefix, and in a batch."""
    llm = LLM(tiny, dtype=dtype, kv_cache_dtype="fp8", quantization="none",
              kv_cache_memory_gb=0.001)
    ref = LLM(tiny, dtype=dtype, quantization="none", kv_cache_memory_gb=0.001)
    m, r = llm.model, ref.model
    D = m.config.head_dim
    assert m.kv_cache.dtype is torch.uint8 and m.kv_cache.shape[-1] == D + SCALE
    assert m.kv_geometry.dtype == "fp8_e4m3" and m.kv_geometry.model_dtype == dtype
    assert m.kv_geometry.block_bytes == m.kv_cache[0].numel()
    assert m.kv_geometry.block_bytes * r.kv_cache.element_size() * D == (
        r.kv_geometry.block_bytes * (D + SCALE))
    assert m.num_blocks > r.num_blocks
    assert m.kv_geometry.compat_hash("m") != r.kv_geometry.compat_hash("m")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = list(range(3, 40))
    cold = llm.generate([prompt], params)[0].outputs[0].token_ids
    warm = llm.generate([prompt], params)[0].outputs[0].token_ids  # the prefix cached
    batch = llm.generate([prompt, list(range(5, 20))], params)[0].outputs[0].token_ids
    assert cold == warm == batch and len(cold) == 8


def test_fp8_is_refused_without_the_native_kernels(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_KERNELS", "torch")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs the native CPU kernels"):
        LLM(tiny, dtype="float32", kv_cache_dtype="fp8")
