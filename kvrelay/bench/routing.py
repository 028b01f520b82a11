"""``kvrelay bench routing``: KV-aware routing (by guesses, and by the engines' KV
events) against least-outstanding routing, on 2P2D behind the proxy, in one run.

For each routing (least-outstanding first, the reference, then kv-aware: the proxy's
guesses from the prompts it sent, then kv-events: the engines publish their KV events,
``--kv-events-config``, and the proxy routes by them, ``--kv-events``) a fresh
cluster starts: two prefill and two decode engines (embedded model by default,
bfloat16, one thread each) and the proxy with ``--routing`` set. Each engine gets one
short warm-up request straight (not through the proxy). Then ``--num-requests``
streamed completions go through the proxy at ``--concurrency``: ``--num-prefixes``
distinct shared prefixes of ``--prefix-len`` common words (about a token each),
interleaved (request i uses prefix i mod the count), each with its own tail of
``--tail-len`` words. Printed per routing: the prefix-cache hit rate of the prefill
and of the decode engines (tokens found cached / tokens looked up, from the engines'
own ``/metrics``), the proxy's routing reasons, TTFT p50, p90 and mean as the client sees it;
last, the TTFT mean and p50 ratios of each routing over least-outstanding, and of
kv-events over kv-aware (events against guesses). Before the kv-events load, each engine
gets short requests straight until the proxy has applied one of its event batches (its
subscriber is past ZMQ's slow joiner).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.bench.serve import WORDS, RequestResult, discover_model, percentiles, send_one

ROUTINGS = ("least-outstanding", "kv-aware", "kv-events")  # the reference first
EVENTS_CONFIG = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                            "replay_endpoint": "tcp://*:0"})
HIT_NAMES = ("kvrelay_prefix_cache_hits_total", "kvrelay_prefix_cache_queries_total")


def add_engine_args(p: Any) -> None:
    """The engines' flags of a benchmark that starts its own clusters (routing, conditional)."""
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU computes it natively, else float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "routing", help="KV-aware routing (guesses, KV events) vs least-outstanding on 2P2D "
        "(shared prefixes)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    add_engine_args(p)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per engine (default: the engine's own default)")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=768, help="shared prefix, words")
    p.add_argument("--tail-len", type=int, default=16, help="distinct tail, words")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routings", nargs="+", choices=ROUTINGS, default=list(ROUTINGS),
                   help="which to run (default: all; least-outstanding, the reference, "
                        "is always run)")
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS")
    p.set_defaults(func=run)


def make_prompts(n: int, num_prefixes: int, prefix_len: int, tail_len: int,
                 seed: int) -> list[str]:
    """Request i: prefix i mod num_prefixes, then a tail of its own."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    prefixes = [f"Document {j}: {words(prefix_len)}" for j in range(num_prefixes)]
    return [f"{prefixes[i % num_prefixes]}\nQuestion {i}: {words(tail_len)}"
            for i in range(n)]


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics, keyed by name and labels (model_name dropped)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass
class Outcome:
    routing: str
    results: list[RequestResult]
    hits: dict[str, tuple[float, float]]  # role -> (hit tokens, looked-up tokens)
    reasons: dict[str, float]  # 'role/reason' -> picks

    def hit_rate(self, role: str) -> str:
        hits, queries = self.hits[role]
        return f"{hits / queries:.1%}" if queries else "n/a"


def run(args: argparse.Namespace) -> int:
    from kvrelay.errors import UsageError
    from kvrelay.model.loader import concrete_dtype

    args.dtype = concrete_dtype(args.dtype, args.model, getattr(args, "device", "cpu"))
    if args.num_prefixes < 1 or args.num_requests < 1 or args.concurrency < 1:
        raise UsageError("--num-prefixes, --num-requests and --concurrency must be >= 1")
    prompts = make_prompts(args.num_requests, args.num_prefixes, args.prefix_len,
                           args.tail_len, args.seed)
    chosen = [r for r in ROUTINGS if r == ROUTINGS[0] or r in args.routings]
    outcomes = [one_routing(args, routing, prompts) for routing in chosen]
    print(report(args, outcomes))
    failed = sum(not r.ok for o in outcomes for r in o.results)
    return 1 if failed else 0


def one_routing(args: argparse.Namespace, routing: str, prompts: list[str]) -> Outcome:
    from kvrelay.demo import Deployment, ServerProcess

    base = ([args.model] if args.model else []) + [
        "--dtype", args.dtype, "--threads", str(args.threads)]
    if args.num_blocks:
        base += ["--num-blocks", str(args.num_blocks)]
    events = routing == "kv-events"
    if events:
        base += ["--kv-events-config", EVENTS_CONFIG]
    logs = Path(tempfile.mkdtemp(prefix=f"kvrelay-bench-routing-{routing}-"))
    engines = {role: [ServerProcess([*base, "--role", role],
                                    log_path=str(logs / f"{role}-{i}.log"))
                      for i in range(2)] for role in ("prefill", "decode")}
    proxy = ServerProcess(
        ["--prefill", *(e.base_url for e in engines["prefill"]),
         "--decode", *(e.base_url for e in engines["decode"]),
         *(["--routing", "kv-aware", "--kv-events"] if events else ["--routing", routing])],
        command="proxy", log_path=str(logs / "proxy.log"))
    cluster = Deployment([*engines["prefill"], *engines["decode"], proxy])
    try:
        cluster.start(args.start_timeout)
        all_engines = [*engines["prefill"], *engines["decode"]]
        model = asyncio.run(warm_up([e.base_url for e in all_engines]))
        proxy_sees_all_healthy(proxy.base_url, len(all_engines), args.start_timeout)
        if events:
            asyncio.run(events_flowing(proxy.base_url, [e.base_url for e in all_engines],
                                       model, args.start_timeout))
        before = {e.base_url: scrape(e.base_url) for e in all_engines}
        results = [res for _, res in asyncio.run(load(proxy.base_url, model, prompts, args))]
        hits = {}
        for role, procs in engines.items():
            delta = [sum(scrape(e.base_url).get(n, 0.0) - before[e.base_url].get(n, 0.0)
                         for e in procs) for n in HIT_NAMES]
            hits[role] = (delta[0], delta[1])
        reasons = {}
        for key, value in scrape(proxy.base_url).items():
            if key.startswith("kvrelay_proxy_route_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
                reasons[f"{labels['role']}/{labels['reason']}"] = value
    except Exception:
        print(f"the {routing} cluster failed; its logs are in {logs}")
        raise
    finally:
        cluster.stop()
    return Outcome(routing, results, hits, reasons)


def proxy_sees_all_healthy(url: str, engines: int, timeout: float) -> None:
    """Wait for the proxy's health checks to pass on every engine: until then it would
    route around engines it has not yet seen up (reason no_healthy)."""
    deadline = time.monotonic() + timeout
    while True:
        healthy = sum(v for k, v in scrape(url).items()
                      if k.startswith("kvrelay_proxy_engine_healthy{"))
        if healthy == engines:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the proxy saw {healthy:.0f} of {engines} engines healthy "
                               f"after {timeout:.0f} s")
        time.sleep(0.2)


async def events_flowing(proxy_url: str, urls: list[str], model: str,
                         timeout: float) -> None:
    """Distinct short prompts (a few blocks each) straight to each engine until the
    proxy has applied a batch of its events: its subscriber is connected."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=120.0) as client:
        for k, url in enumerate(urls):
            for i in range(10_000):
                m = scrape(proxy_url)
                if m.get(f'kvrelay_proxy_kv_event_batches_total{{url="{url}"}}', 0.0) > 0:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the proxy applied no KV event of {url} within "
                                       f"{timeout:.0f} s")
                words = " ".join(WORDS[(7 * i + j + 97 * k) % len(WORDS)] for j in range(48))
                r = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": f"Subscribe {k}-{i}: {words}", "max_tokens": 1})
                r.raise_for_status()


async def warm_up(urls: list[str]) -> str:
    """One short request on each engine itself (first-call costs out of the figures);
    the served model's name."""
    import httpx

    async with httpx.AsyncClient(timeout=120.0) as client:
        model = await discover_model(client, urls[0])
        for url in urls:
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": "warm up the engine", "max_tokens": 2,
                "ignore_eos": True})
            r.raise_for_status()
    return model


async def load(proxy_url: str, model: str, prompts: list[str],
               args: argparse.Namespace) -> list[tuple[float, RequestResult]]:
    """The prompts' streamed completions at ``--concurrency``: each one's send time (s
    since the first) and result."""
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=600.0) as client:
        async def one(prompt: str) -> tuple[float, RequestResult]:
            async with sem:
                at = time.perf_counter() - t0
                return at, await send_one(client, proxy_url + "/v1/completions", {
                    "model": model, "prompt": prompt, "max_tokens": args.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}})

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def report(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    lines = [
        f"workload: 2P2D, {args.num_requests} requests, {args.num_prefixes} shared prefixes "
        f"of {args.prefix_len} words interleaved, {args.tail_len}-word tails, concurrency "
        f"{args.concurrency}, max_tokens {args.output_len}; {args.dtype}, "
        f"{args.threads} thread(s) per engine, "
        f"{args.num_blocks or 'default'} KV blocks per engine",
        f"{'routing':<19}{'ok':>4}{'P hit rate':>12}{'D hit rate':>12}"
        f"{'TTFT p50 ms':>13}{'p90 ms':>9}{'mean ms':>9}  routing reasons",
    ]
    p50, mean = {}, {}
    for o in outcomes:
        ok = [r for r in o.results if r.ok]
        ttft = percentiles([r.ttft_s * 1e3 for r in ok])
        p50[o.routing], mean[o.routing] = ttft["p50"], ttft["mean"]
        why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(o.reasons.items()) if v)
        lines.append(f"{o.routing:<19}{len(ok):>4}{o.hit_rate('prefill'):>12}"
                     f"{o.hit_rate('decode'):>12}{ttft['p50']:>13.1f}{ttft['p90']:>9.1f}"
                     f"{ttft['mean']:>9.1f}  {why}")
        errors = sorted({r.error for r in o.results if not r.ok})[:3]
        if errors:
            lines.append(f"  errors: {'; '.join(errors)}")
    pairs = [(r, "least-outstanding") for r in ROUTINGS[1:]] + [("kv-events", "kv-aware")]
    for over, ref in pairs:
        if p50.get(ref) and over in p50:
            lines.append(f"TTFT mean ratio {over}/{ref}: {mean[over] / mean[ref]:.3f}")
            lines.append(f"TTFT p50 ratio {over}/{ref}: {p50[over] / p50[ref]:.3f}")
    return "\n".join(lines)
