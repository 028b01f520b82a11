"""``kvrelay bench offline``: kvrelay's offline API against transformers' batched
``generate`` on the same model, weights, prompts and threads, in one run.

Workload (defaults): 32 prompts of 128 tokens, 128 output tokens each, greedy,
ignore_eos. Prints output tokens/s of both and, last, the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from typing import Any

_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders "
    "met to exchange grain, salt and cloth. Over the centuries it grew into a busy port, "
    "with bridges, markets, churches and a university that drew students from far away. "
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "offline",
        help="offline throughput: kvrelay.LLM vs transformers generate",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU computes it natively, else float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--skip-transformers", action="store_true",
                   help="only kvrelay's run (no reference, no ratio)")
    p.add_argument(
        "--kernels-vs-torch", type=int, default=0, metavar="ROUNDS",
        help="also run kvrelay on its pure-torch kernels, alternating with the native ones "
        "ROUNDS times, and print native/torch (best round of each)",
    )
    p.set_defaults(func=run)


def make_prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``length`` tokens."""
    prompts = []
    for i in range(n):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(f"Chapter {i}. {_TEXT}", add_special_tokens=False)
        prompts.append(ids[:length])
    return prompts


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from kvrelay.errors import UsageError
    from kvrelay.model.loader import concrete_dtype

    args.dtype = concrete_dtype(args.dtype, args.model, getattr(args, "device", "cpu"))
    if not args.skip_transformers and importlib.util.find_spec("transformers") is None:
        # Say it before minutes of kvrelay's own run, not with a traceback after.
        raise UsageError("the reference run needs the package 'transformers', which is not "
                         "installed (pip install transformers, or pass --skip-transformers)")
    with torch_threads(args.threads):
        return _run(args)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch CPU threads, then give back the caller's setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> int:
    llm, prompts, outs, ours_s = _kvrelay_run(args, None)
    ours_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"workload: {args.num_prompts} prompts x {args.prompt_len} tokens, "
        f"{args.output_len} output tokens, greedy, ignore_eos; model {llm.model.name}; "
        f"{args.dtype}; {args.device}; {args.threads} threads; "
        f"kernels {llm.model.runner.model.backend.name}"
    )
    print(f"{'engine':<14}{'seconds':>10}{'output tok/s':>15}")
    print(f"{'kvrelay':<14}{ours_s:>10.2f}{ours_tokens / ours_s:>15.1f}")
    if args.kernels_vs_torch:
        _kernels_vs_torch(args, ours_tokens)
    if args.skip_transformers:
        return 0
    ref_s, ref_out = _transformers_run(llm, prompts, args)
    ref_tokens = sum(len(r) for r in ref_out)
    print(f"{'transformers':<14}{ref_s:>10.2f}{ref_tokens / ref_s:>15.1f}")
    # Same model, same greedy decoding: outputs should agree (bfloat16 rounding may
    # flip a near-tie and make one diverge from there on).
    same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, ref_out, strict=True))
    print(f"identical outputs: {same}/{len(outs)}")
    ratio = (ours_tokens / ours_s) / (ref_tokens / ref_s)
    print(f"throughput ratio kvrelay/transformers: {ratio:.2f}")
    return 0


def _kvrelay_run(args: argparse.Namespace, kernels: str | None) -> tuple[Any, Any, Any, float]:
    """One kvrelay run of the workload; ``kernels`` as KVRELAY_KERNELS (read at load)."""
    from kvrelay import env
    from kvrelay.model.llm import LLM
    from kvrelay.sampling_params import SamplingParams

    with env.overridden("KVRELAY_KERNELS", kernels):
        per_seq = args.prompt_len + args.output_len
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            num_blocks=args.num_prompts * (-(-per_seq // 16)) + 16,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    prompts = make_prompts(llm.tokenizer, args.num_prompts, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return llm, prompts, outs, time.perf_counter() - start


def _kernels_vs_torch(args: argparse.Namespace, tokens: int) -> None:
    """Native and torch kernels alternately, best round of each: the machine's load
    moves single runs by 2x, alternation spreads it over both."""
    best = {"native": float("inf"), "torch": float("inf")}
    texts: dict[str, list[list[int]]] = {}
    for _ in range(args.kernels_vs_torch):
        for kernels in ("torch", "native"):
            llm, _, outs, seconds = _kvrelay_run(args, kernels)
            name = llm.model.runner.model.backend.name
            best[name] = min(best.get(name, float("inf")), seconds)
            texts[name] = [o.outputs[0].token_ids for o in outs]
            print(f"{'kvrelay ' + name:<14}{seconds:>10.2f}{tokens / seconds:>15.1f}")
    if "native" not in texts:
        print("native kernels unavailable: nothing to compare")
        return
    same = sum(a == b for a, b in zip(texts["native"], texts["torch"], strict=True))
    print(f"identical outputs native/torch: {same}/{len(texts['torch'])}")
    print(f"throughput ratio native/torch kernels: {best['torch'] / best['native']:.2f}")


def _transformers_run(
    llm: Any, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[list[int]]]:
    import torch

    # The dtype the engine runs (auto resolved), so both sides compute alike.
    model = reference_model(llm.model.path, llm.model.config, llm.model.dtype,
                            args.device)
    ids = torch.tensor(prompts, device=args.device)
    kwargs: dict[str, Any] = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            **kwargs,
        )
        seconds = time.perf_counter() - start
    return seconds, out[:, ids.shape[1] :].tolist()


def reference_model(path: Any, cfg: Any, dtype: str, device: str) -> Any:
    """A transformers model with the weights our loader reads (GGUF: dequantized)."""
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
    if path.is_dir():
        auto: Any = transformers.AutoModelForCausalLM
        return auto.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
    from kvrelay.model.formats.gguf_loader import GgufModel

    state, _ = GgufModel(path).state_dict()
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    hf_cfg = config_cls[cfg.architecture](
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=torch_dtype).eval()
