"""``kvrelay generate``: one prompt in, the model's text streamed to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvrelay.errors import EXIT_USAGE


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one prompt (offline, no server)",
        description="Generate text for PROMPT with a local model; the text streams to stdout.",
    )
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M)",
    )
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_model_args(p)
    p.set_defaults(func=run)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto: on a CPU bfloat16 where it computes "
                   "bf16 natively (avx512_bf16, amx_bf16), else float32; on CUDA the "
                   "checkpoint's")
    p.add_argument("--quantization", choices=["auto", "none", "gguf"], default="auto",
                   help="gguf: serve a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights as "
                   "stored (native kernels); none: dequantize at load; auto: gguf where it can "
                   "run, else none")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"],
                   help="KV cache dtype; auto: the model's (--dtype). bfloat16 under a float32 "
                   "model halves the cache's memory and the bytes a decode step reads; fp8 "
                   "(fp8_e4m3: e4m3 codes and a float16 scale per token and head, native "
                   "kernels only) takes about a quarter of float32's, half of bfloat16's")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (never used on CPU)")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.model.llm import LLM
    from kvrelay.sampling_params import InvalidParameter, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except InvalidParameter as e:
        print(f"kvrelay generate: --{e.param.replace('_', '-')}: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, num_blocks=None,
                  enforce_eager=args.enforce_eager, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # RuntimeError: bad --device
        print(f"kvrelay generate: {e}", file=sys.stderr)
        return EXIT_USAGE

    def show(_: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        llm.chat(messages, params, on_text=show)
    else:
        llm.generate(args.prompt, params, on_text=show)
    sys.stdout.write("\n")
    return 0
