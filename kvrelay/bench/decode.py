"""``kvrelay bench decode``: the decode step against its weight-streaming floor, with
the native small-M GEMM and with oneDNN's packed GEMM, in one run.

A decode step reads every weight once, so its floor is the weights' bytes over the
machine's read bandwidth, measured here in the same run (``torch.sum`` over a buffer
of the weights' size, same threads, best of 5 passes). Two engines on one model, the
GEMM chosen at load (``KVRELAY_NATIVE_GEMM=1`` and ``=0``), step ``batch`` requests
(prompts of ``--prompt-len`` tokens, greedy, ignore_eos) in alternating rounds; a
step's time is the wall time of ``Engine.step`` once every request decodes, p50 over
its steps, best round. Prints per batch size both p50s, oneDNN/native and
native/floor (the issue's goal: within 1.5x at batch 8). ``--quantization gguf``: the
GGUF's codes served as stored against the dequantized weights on the native float GEMM,
the floor being the bytes of the codes (the served size).

A step also reads its requests' KV cache, which the weight floor leaves out: the last
column divides by the floor of both (weights plus the K and V of ``batch`` contexts at
their mean length over the measured steps, at the KV cache's dtype and the same
bandwidth), the least any step of that batch can take.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvrelay import env
from kvrelay.bench.offline import make_prompts, torch_threads

# name, KVRELAY_NATIVE_GEMM, quantization: the reference first, the measured second
_SETTINGS = {
    "none": (("onednn", "0", "none"), ("native", "1", "none")),
    "gguf": (("none", "1", "none"), ("gguf", "1", "gguf")),
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "decode",
        help="decode step time vs the weight-streaming floor, native GEMM vs oneDNN",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"],
                   help="both engines' KV cache dtype (auto: --dtype)")
    p.add_argument("--quantization", default="none", choices=sorted(_SETTINGS),
                   help="none: the float weights, native GEMM against oneDNN; gguf: the "
                   "GGUF's codes as stored against the float weights (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads):
        return _run(args)


def _load(args: argparse.Namespace, gemm_env: str, quantization: str) -> Any:
    from kvrelay.model.llm import LLM

    with env.overridden("KVRELAY_NATIVE_GEMM", gemm_env):
        per_seq = -(-(args.prompt_len + args.steps + 2) // 16)
        return LLM(args.model, dtype=args.dtype, num_blocks=max(args.batch) * per_seq + 16,
                   quantization=quantization, kv_cache_dtype=args.kv_cache_dtype)


def weight_bytes(model: Any) -> int:
    """Bytes a decode step streams: every Linear's weight (the lm_head included), as
    served: the GGUF codes where the quantized GEMM has them."""
    import torch

    linears = [model.lm_head] + [
        lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    total = 0
    for lin in linears:
        codes = lin.small_w is not None and lin.small_w.dtype == torch.uint8
        w = lin.small_w if codes else lin.weight
        total += w.numel() * w.element_size()
    return total


def read_bandwidth(nbytes: int) -> float:
    """Bytes/s of ``torch.sum`` over a float32 buffer of ``nbytes``, best of 5 passes."""
    import torch

    buf = torch.ones(max(nbytes, 1 << 20) // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def step_p50(llm: Any, prompts: list[list[int]], steps: int, tag: str) -> float:
    """p50 wall time of the engine's steps in which every request decodes."""
    from kvrelay.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    times: list[float] = []
    while engine.has_work():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        # the first step that answers every request ends their prefill
        if len(times) or sum(1 for o in outs if o.new_token_ids) == len(prompts):
            times.append(elapsed)
    return statistics.median(times[1:]) if len(times) > 1 else float("nan")


def _run(args: argparse.Namespace) -> int:
    settings = _SETTINGS[args.quantization]
    (ref, _, _), (mine, _, _) = settings
    llms = {name: _load(args, gemm, quant) for name, gemm, quant in settings}
    model = llms[mine].model.runner.model
    from kvrelay.model.kernels import choice as kernel_choice

    nbytes = weight_bytes(model)
    # Fresh prompts for every measurement: no prefix-cache hits between them.
    prompts = make_prompts(llms[mine].tokenizer, sum(args.batch) * args.rounds * 2,
                           args.prompt_len)
    best: dict[tuple[str, int], float] = {}
    bw, n = 0.0, 0
    for r in range(args.rounds):
        bw = max(bw, read_bandwidth(nbytes))
        for batch in args.batch:
            for name, _, _ in settings:
                p50 = step_p50(llms[name], prompts[n : n + batch], args.steps, f"{r}-{batch}")
                n += batch
                best[name, batch] = min(best.get((name, batch), float("inf")), p50)
    floor_ms = nbytes / bw * 1e3
    print(f"model {llms[mine].model.name}; {args.dtype}, KV cache "
          f"{llms[mine].model.kv_geometry.dtype}; {args.threads} threads; "
          f"native GEMM {kernel_choice.info()['gemm']}; prompts of {args.prompt_len} tokens, "
          f"{args.steps} decode steps each; best of {args.rounds} alternating rounds")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s (torch.sum over {nbytes / 1e6:.0f} MB) -> "
          f"weight-streaming floor {floor_ms:.1f} ms ({nbytes / 1e6:.0f} MB of weights)")
    # the measured steps run from prompt_len + 1 to prompt_len + steps tokens of context
    mean_ctx = args.prompt_len + (args.steps + 1) / 2
    geom = llms[mine].model.kv_geometry  # K and V of a block, every layer
    kv_token = geom.block_bytes / geom.block_size * mean_ctx
    print(f"KV cache read per step: {kv_token / 1e6:.2f} MB per request (mean context "
          f"{mean_ctx:.0f} tokens)")
    print(f"{'batch':>5}{ref + ' p50 ms':>15}{mine + ' p50 ms':>15}{ref + '/' + mine:>15}"
          f"{mine + '/floor':>14}{'/(w+KV) floor':>15}")
    for batch in args.batch:
        one, nat = best[ref, batch] * 1e3, best[mine, batch] * 1e3
        both_ms = (nbytes + batch * kv_token) / bw * 1e3
        print(f"{batch:>5}{one:>15.1f}{nat:>15.1f}{one / nat:>15.2f}{nat / floor_ms:>14.2f}"
              f"{nat / both_ms:>15.2f}")
    return 0
