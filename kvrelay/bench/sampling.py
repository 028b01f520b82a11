"""``kvrelay bench sampling``: what vLLM's penalties and masks cost per decode step.

The sampler on a decode-sized batch of SmolLM2-sized logits (49152 tokens), each
request ``--prompt`` tokens in and ``--output`` tokens out, with none of the
parameters (the reference, measured in the same run) and with each of
frequency/presence/repetition penalties, min_tokens, bad_words and
allowed_token_ids, on every row and on a quarter of the rows. A step's history
update (``observe``: the one new token of every row) is timed with the sampling.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

VOCAB = 49152


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sampling", help="penalties, min_tokens, bad_words, "
                              "allowed_token_ids: sampler cost per step against none",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--batch", type=int, default=32, help="rows (requests) per decode step")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=256, help="output tokens so far per request")
    p.add_argument("--repeat", type=int, default=30, help="timed steps (the median is shown)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvrelay.sampling_params import SamplingParams as SP

    cases: list[tuple[str, dict[str, Any]]] = [
        ("frequency+presence", {"frequency_penalty": 0.5, "presence_penalty": 0.5}),
        ("repetition", {"repetition_penalty": 1.2}),
        ("all three penalties", {"frequency_penalty": 0.5, "presence_penalty": 0.5,
                                 "repetition_penalty": 1.2}),
        ("min_tokens", {"min_tokens": args.output + 10}),
        ("bad_words (8)", {"bad_words_token_ids": tuple((i, i + 1) for i in range(8))}),
        ("allowed_token_ids (1k)", {"allowed_token_ids": tuple(range(1000))}),
    ]
    print(f"sampler, {args.batch} rows x {VOCAB} tokens, prompt {args.prompt}, output "
          f"{args.output}; median of {args.repeat} steps, greedy and temperature 0.8")
    print(f"{'parameters':<24}{'rows':>6}{'greedy ms':>11}{'ratio':>7}{'sampled ms':>12}"
          f"{'ratio':>7}")
    ref = [_step_ms(args, lambda i, t=t: SP(max_tokens=100000, temperature=t))
           for t in (0.0, 0.8)]
    print(f"{'none (reference)':<24}{args.batch:>6}{ref[0]:>11.2f}{1.0:>7.2f}{ref[1]:>12.2f}"
          f"{1.0:>7.2f}")
    for name, kw in cases:
        for share in (1, 4):
            times = [_step_ms(args, lambda i, t=t, s=share, kw=kw: SP(
                max_tokens=100000, temperature=t, **(kw if i % s == 0 else {})))
                for t in (0.0, 0.8)]
            rows = (args.batch + share - 1) // share
            print(f"{name:<24}{rows:>6}{times[0]:>11.2f}{times[0] / ref[0]:>7.2f}"
                  f"{times[1]:>12.2f}{times[1] / ref[1]:>7.2f}")
    return 0


def _step_ms(args: argparse.Namespace, make: Any) -> float:
    """Median ms of one decode step's observe + sample, every row one token further."""
    import torch

    from kvrelay.core.runner import ScheduledRequest
    from kvrelay.model.sampling.sampler import Sampler

    rng = random.Random(0)
    sampler = Sampler(0)
    sampler.rules.eos_token_ids = (0,)
    n = args.batch
    params = [make(i) for i in range(n)]
    rids = [f"r{i}" for i in range(n)]
    seqs = [[rng.randrange(VOCAB) for _ in range(args.prompt + args.output)] for _ in range(n)]
    sampler.observe([ScheduledRequest(rids[i], seqs[i], 0, [], True, params[i], args.prompt,
                                      seqs[i]) for i in range(n)], lambda sr: sr.token_ids)
    logits = torch.randn(n, VOCAB)
    times = []
    for step in range(args.repeat + 3):
        pos = len(seqs[0])
        chunks = [ScheduledRequest(rids[i], [seqs[i][-1]], pos - 1, [], True, params[i],
                                   args.prompt, seqs[i]) for i in range(n)]
        batch_logits = logits.clone()
        t0 = time.perf_counter()
        sampler.observe(chunks, lambda sr: sr.token_ids)
        out = sampler.sample(batch_logits, params, [pos] * n, rids)
        if step >= 3:  # warm-up: first samples build the history tensors
            times.append(time.perf_counter() - t0)
        for i in range(n):
            seqs[i].append(out[i].token_id)
    times.sort()
    return times[len(times) // 2] * 1e3
