"""``kvrelay bench quant``: a GGUF served as stored (``--quantization gguf``) against the
same file dequantized at load (``none``), in one run: greedy token agreement on a prompt
set, perplexity on a local text, and the batch-1 decode step (TPOT) of both.

Per dtype (float32, bfloat16), two engines on one GGUF. Prompts: ``--num-prompts``
windows of ``--prompt-len`` tokens from the text, ``--output-len`` greedy tokens each;
agreement: identical outputs, and the mean share of each output before the first
token that differs. Perplexity: the first ``--ppl-tokens`` tokens of the text, fed in
chunks of 16 so every GEMM takes the decode-sized path that serves the stored weights.
TPOT: p50 of ``Engine.step`` at each ``--batch`` size (bench decode's measure; the
row shows the first, a line per dtype the others), best of ``--rounds`` alternating
rounds.

``--kv-cache-dtype fp8`` compares KV caches instead of weights: the GGUF served as
stored by both engines, one with the model dtype's KV (``auto``), the other with the
8-bit KV; the same measures, columns named ``auto`` and ``fp8``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from kvrelay.bench.decode import step_p50
from kvrelay.bench.offline import torch_threads

_DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
_CHUNK = 16


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quant",
        help="GGUF served as stored vs dequantized: agreement, perplexity, batch-1 TPOT",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded one)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--text", default=_DEFAULT_TEXT,
                   help=f"a local text for prompts and perplexity (default: {_DEFAULT_TEXT})")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="decode steps per TPOT measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1],
                   help="decode batch sizes of the TPOT measurement")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8", "fp8_e4m3"],
                   help="compare this KV cache against the model dtype's (both engines "
                        "serving the GGUF as stored) instead of weights")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads):
        return _run(args)


def perplexity(llm: Any, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids[1:]``, fed through the runner ``_CHUNK`` tokens a step."""
    import torch

    from kvrelay.model.kernels.attention import ChunkSpec

    runner = llm.model.runner
    bs = runner.block_size
    blocks = list(range(-(-len(ids) // bs)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, _CHUNK):
        n = min(_CHUNK, len(ids) - 1 - start)
        logits = runner._forward(ids[start : start + n], list(range(start, start + n)),
                                 [ChunkSpec(start, n, blocks)], list(range(n)))
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[start + 1 : start + n + 1])
        nll -= logp[torch.arange(n), target].sum().item()
        count += n
    return math.exp(nll / count)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """Identical outputs, and the mean share of each output before the first difference."""
    same, share = 0, 0.0
    for x, y in zip(a, b, strict=True):
        same += x == y
        first = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v),
                     min(len(x), len(y)))
        share += first / max(len(x), 1)
    return same, share / len(a)


def _pair(args: argparse.Namespace, dtype: str, text_ids: list[int]) -> dict[str, Any]:
    from kvrelay.model.kernels import choice as kernel_choice
    from kvrelay.model.llm import LLM
    from kvrelay.sampling_params import SamplingParams

    need = max(args.ppl_tokens, args.prompt_len + args.output_len) + args.steps + 64
    seqs = max(args.num_prompts, max(args.batch)) + 2
    llms: dict[str, Any] = {}
    labels: dict[str, str] = {}
    ref, test = sides(args)
    for side in (ref, test):
        quant, kv = ("gguf", side) if args.kv_cache_dtype else (side, "auto")
        llms[side] = LLM(args.model, dtype=dtype, quantization=quant, kv_cache_dtype=kv,
                         num_blocks=seqs * (-(-need // 16)))
        labels[side] = kernel_choice.info()["gemm"]
    step = max(1, (len(text_ids) - args.prompt_len) // args.num_prompts)
    prompts = [text_ids[i * step : i * step + args.prompt_len] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Perplexity first: it writes the KV blocks from 0 on behind the pool's back, which
    # is harmless only while the pool holds nothing (before any request ran).
    ppl = {q: perplexity(llm, text_ids[: args.ppl_tokens]) for q, llm in llms.items()}
    outs = {q: [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            for q, llm in llms.items()}
    tpot = {(q, b): float("inf") for q in llms for b in args.batch}
    for r in range(args.rounds):
        for b in args.batch:
            for q, llm in llms.items():
                batch = [text_ids[(r * 16 + i) * 7 : (r * 16 + i) * 7 + args.prompt_len]
                         for i in range(b)]
                p50 = step_p50(llm, batch, args.steps, f"tpot-{r}-{b}-{q}")
                tpot[q, b] = min(tpot[q, b], p50)
    same, share = agreement(outs[test], outs[ref])
    return {"labels": labels, "same": same, "share": share, "ppl": ppl, "tpot": tpot}


def sides(args: argparse.Namespace) -> tuple[str, str]:
    """(the reference, the side measured against it): quantization modes, or KV dtypes."""
    return ("auto", args.kv_cache_dtype) if args.kv_cache_dtype else ("none", "gguf")


def _run(args: argparse.Namespace) -> int:
    from kvrelay.model.formats.gguf_loader import GgufModel
    from kvrelay.model.loader import default_model_path

    text_path = Path(args.text)
    if not text_path.is_file():
        from kvrelay.errors import UsageError

        raise UsageError(f"--text {args.text}: no such file (pass a local text file)")
    text = text_path.read_text(errors="replace")
    args.model = args.model or str(default_model_path())
    tok = GgufModel(Path(args.model)).tokenizer
    text_ids = tok.encode(text, add_special_tokens=False)
    print(f"model {os.path.basename(args.model)}; text {text_path} ({len(text_ids)} tokens); "
          f"{args.threads} threads; {args.num_prompts} prompts x {args.prompt_len} tokens, "
          f"{args.output_len} greedy out; perplexity over {args.ppl_tokens} tokens; "
          f"TPOT: batch {'/'.join(map(str, args.batch))}, p50 of {args.steps} steps, "
          f"best of {args.rounds} rounds"
          + (f"; KV caches: auto against {args.kv_cache_dtype}, weights as stored"
             if args.kv_cache_dtype else ""))
    a, b = sides(args)
    print(f"{'dtype':<9}{f'GEMM ({b})':<22}{'identical':>10}{'agree':>7}{f'ppl {a}':>10}"
          f"{f'ppl {b}':>10}{f'TPOT {a}':>11}{f'TPOT {b}':>11}{f'{a}/{b}':>11}"
          f"{'ppl change':>12}")
    for dtype in args.dtype:
        r = _pair(args, dtype, text_ids)
        b0 = args.batch[0]
        t_a, t_b = r["tpot"][a, b0] * 1e3, r["tpot"][b, b0] * 1e3
        change = r["ppl"][b] / r["ppl"][a] - 1
        print(f"{dtype:<9}{r['labels'][b]:<22}{r['same']:>5}/{args.num_prompts:<4}"
              f"{r['share']:>7.3f}{r['ppl'][a]:>10.3f}{r['ppl'][b]:>10.3f}"
              f"{t_a:>9.1f}ms{t_b:>9.1f}ms{t_a / t_b:>11.2f}{100 * change:>+11.2f}%")
        for n in args.batch[1:]:
            t_a, t_b = r["tpot"][a, n] * 1e3, r["tpot"][b, n] * 1e3
            print(f"  {dtype} batch {n}: TPOT {a} {t_a:.1f} ms, {b} {t_b:.1f} ms, "
                  f"{a}/{b} {t_a / t_b:.2f}")
    return 0
