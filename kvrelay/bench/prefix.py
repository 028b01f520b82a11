"""``kvrelay bench prefix``: time to first token with prefix caching against without,
on the same model, prompts and threads, in one run.

Workload (defaults, the goal of issue 13): 32 requests sharing a 1,000-token system
prompt and differing in a 24-token tail, sent one at a time, max_tokens 8, greedy.
Two engines over the same weights (one with ``enable_prefix_caching``, one without)
take the requests in turn, so both see the same machine load. Prints the median TTFT
of each, whether their outputs are identical, and, last, the ratio cached/uncached.

``--pd``: the same through 1P1D instead, each request streamed through a proxy in
front of a prefill and a decode engine (real processes, ``kvrelay serve --role``),
two such deployments side by side (prefix caching on in both engines of one, off in
both of the other) taking the requests in turn. TTFT is the client's (first streamed
token); with caching P computes only the tail and D pulls only the blocks its own
cache lacks, so the bytes D received per request are printed too.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvrelay.bench.serve import WORDS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "prefix", help="TTFT with prefix caching vs without (shared system prompt)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU computes it natively, else float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1000, help="shared prompt, tokens")
    p.add_argument("--tail-len", type=int, default=24, help="distinct tail, tokens")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pd", action="store_true",
                   help="through 1P1D and a proxy (real processes) instead of in-process "
                        "colocated engines; --threads is then per engine")
    p.add_argument("--kv-transport", choices=("auto", "shm", "tcp"), default="auto",
                   help="--pd: how the decode engines pull KV")
    p.set_defaults(func=run)


def make_prompts(tokenizer: Any, n: int, prefix_len: int, tail_len: int,
                 seed: int) -> list[list[int]]:
    rng = random.Random(seed)

    def tokens(length: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < length:
            text = " ".join(rng.choice(WORDS) for _ in range(64))
            ids += tokenizer.encode(text, add_special_tokens=False)
        return ids[:length]

    prefix = tokens(prefix_len)
    return [prefix + tokens(tail_len) for _ in range(n)]


def ttft_and_tokens(engine: Any, rid: str, prompt: list[int], params: Any) -> tuple[float,
                                                                                      list[int]]:
    """Run one request alone to completion: (seconds to its first token, its tokens)."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first: float | None = None
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            tokens += out.new_token_ids
    assert first is not None
    return first, tokens


def run(args: argparse.Namespace) -> int:
    from kvrelay.bench.offline import torch_threads
    from kvrelay.model.loader import concrete_dtype

    args.dtype = concrete_dtype(args.dtype, args.model, getattr(args, "device", "cpu"))
    if getattr(args, "pd", False):
        return _run_pd(args)
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from kvrelay.model.llm import LLM
    from kvrelay.sampling_params import SamplingParams

    per_seq = args.prefix_len + args.tail_len + args.output_len
    blocks = 2 * (-(-per_seq // 16)) + 8
    llms = {caching: LLM(args.model, dtype=args.dtype, num_blocks=blocks,
                         enable_prefix_caching=caching) for caching in (False, True)}
    engines = {caching: llm.engine for caching, llm in llms.items()}
    llm_tok = llms[False].tokenizer
    prompts = make_prompts(llm_tok, args.num_requests, args.prefix_len, args.tail_len,
                           args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = make_prompts(llm_tok, 1, 64, 8, args.seed + 1)[0]
    for caching, engine in engines.items():
        ttft_and_tokens(engine, f"warm-{caching}", warm, params)
    ttft: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, list[list[int]]] = {False: [], True: []}
    for i, prompt in enumerate(prompts):
        for caching, engine in engines.items():
            t, toks = ttft_and_tokens(engine, f"r{i}", prompt, params)
            ttft[caching].append(t)
            outs[caching].append(toks)
    stats = engines[True].scheduler.prefix_stats
    print(f"workload: {args.num_requests} requests, {args.prefix_len}-token shared prefix + "
          f"{args.tail_len}-token tail, sequential, max_tokens {args.output_len}, greedy; "
          f"{args.dtype}; {args.threads} threads")
    print(f"{'prefix caching':<16}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}")
    for caching in (False, True):
        q = statistics.quantiles(ttft[caching], n=10)
        name = "on" if caching else "off"
        print(f"{name:<16}{statistics.median(ttft[caching]) * 1e3:>13.1f}{q[-1] * 1e3:>13.1f}")
    print(f"prefix cache hits: {stats.hits}/{stats.queries} tokens")
    same = sum(a == b for a, b in zip(outs[False], outs[True], strict=True))
    print(f"identical outputs: {same}/{len(prompts)}")
    ratio = statistics.median(ttft[True]) / statistics.median(ttft[False])
    print(f"TTFT p50 ratio cached/uncached: {ratio:.3f}")
    return 0



def _run_pd(args: argparse.Namespace) -> int:
    import httpx

    from kvrelay.demo import Deployment, disaggregated, server_metrics
    from kvrelay.model.loader import load_model

    tokenizer = load_model(args.model, num_blocks=1).tokenizer
    prompts = make_prompts(tokenizer, args.num_requests, args.prefix_len, args.tail_len,
                           args.seed)
    warm = make_prompts(tokenizer, 1, 64, 8, args.seed + 1)[0]
    per_seq = max(args.prefix_len + args.tail_len, len(warm)) + args.output_len
    common = ["--dtype", args.dtype, "--threads", str(args.threads), "--num-blocks",
              str(2 * (-(-per_seq // 16)) + 8), "--max-model-len", str(per_seq + 16)]
    deployments: dict[bool, Deployment] = {
        caching: disaggregated(args.model, [*common, "--enable-prefix-caching" if caching
                                            else "--no-enable-prefix-caching"],
                               args.kv_transport)
        for caching in (False, True)}
    bytes_metric = "kvrelay_kv_transfer_bytes_total"
    try:
        for d in deployments.values():
            d.start(timeout=300)
        with httpx.Client(timeout=300) as client:
            model = client.get(deployments[True].client_url + "/v1/models").json()["data"][0]["id"]
            for d in deployments.values():
                _stream(client, d.client_url, model, warm, args.output_len)
            ttft: dict[bool, list[float]] = {False: [], True: []}
            texts: dict[bool, list[str]] = {False: [], True: []}
            moved: dict[bool, list[float]] = {False: [], True: []}
            for prompt in prompts:
                for caching, d in deployments.items():
                    decode_url = d.servers[1].base_url
                    before = server_metrics(decode_url, (bytes_metric,)).get(bytes_metric, 0.0)
                    t, text = _stream(client, d.client_url, model, prompt, args.output_len)
                    after = server_metrics(decode_url, (bytes_metric,)).get(bytes_metric, 0.0)
                    ttft[caching].append(t)
                    texts[caching].append(text)
                    moved[caching].append(after - before)
            hits = {role: server_metrics(s.base_url, ("kvrelay_prefix_cache_hits_total",
                                                      "kvrelay_prefix_cache_queries_total"))
                    for role, s in zip(("prefill", "decode"), deployments[True].servers,
                                       strict=False)}
    finally:
        for d in deployments.values():
            d.stop()
    print(f"workload: {args.num_requests} requests, {args.prefix_len}-token shared prefix + "
          f"{args.tail_len}-token tail, sequential, max_tokens {args.output_len}, greedy; "
          f"{args.dtype}; 1P1D through the proxy ({args.kv_transport}), {args.threads} "
          "thread(s) per engine")
    print(f"{'prefix caching':<16}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}"
          f"{'KV bytes to D, 1st':>20}{'later (median)':>16}")
    for caching in (False, True):
        q = statistics.quantiles(ttft[caching], n=10)
        name = "on" if caching else "off"
        later = statistics.median(moved[caching][1:]) if len(moved[caching]) > 1 else 0.0
        print(f"{name:<16}{statistics.median(ttft[caching]) * 1e3:>13.1f}"
              f"{q[-1] * 1e3:>13.1f}{moved[caching][0]:>20,.0f}{later:>16,.0f}")
    for role, m in hits.items():
        print(f"prefix cache hits ({role}): {m.get('kvrelay_prefix_cache_hits_total', 0):.0f}/"
              f"{m.get('kvrelay_prefix_cache_queries_total', 0):.0f} tokens")
    same = sum(a == b for a, b in zip(texts[False], texts[True], strict=True))
    print(f"identical outputs: {same}/{len(prompts)}")
    ratio = statistics.median(ttft[True]) / statistics.median(ttft[False])
    print(f"TTFT p50 ratio cached/uncached: {ratio:.3f}")
    return 0


def _stream(client: Any, base_url: str, model: str, prompt: list[int],
            max_tokens: int) -> tuple[float, str]:
    """One streamed completion: (seconds to the first token's text, the whole text)."""
    import json

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    text = ""
    with client.stream("POST", base_url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base_url}: HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text", "")
            if piece and first is None:
                first = time.perf_counter() - start
            text += piece
    if first is None:
        raise RuntimeError(f"{base_url}: the stream carried no text")
    return first, text
