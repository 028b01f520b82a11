"""``kvrelay bench serve``: a load generator for any OpenAI-compatible server.

In the spirit of ``vllm bench serve``: synthetic prompts of about ``--input-len``
tokens (random common words; the server's ``usage`` tells the exact count),
``--output-len`` tokens each (``ignore_eos``), sent at ``--request-rate``
(Poisson arrivals; inf = all at once) with at most ``--concurrency`` in flight,
streamed so that time to first token and inter-token latency can be measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# Common English words; most are one token for the usual BPE tokenizers.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which this "
    "be or has had first one their its new after who they two her she been other when there "
    "all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "team year these game season he also but not war no well film home before "
    "being under while since three four five six seven eight nine ten house water river "
    "music book light green blue red black white small large great early old young long high "
    "north south east west market party power church family group station road line life"
)
WORDS = tuple(_WORD_TEXT.split(" "))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (no /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first listed)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight (default: unlimited)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--prompt-kind", choices=("random", "fixed"), default="random",
                   help="a different random prompt per request, or one prompt for all")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers that reject unknown fields)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--offline-reference", action="store_true",
                   help="afterwards, run the same prompts on the engine in this process (no "
                   "HTTP) and print the ratio served / offline; for a kvrelay server of the "
                   "same model on this machine")
    p.add_argument("--offline-model", default=None,
                   help="model for --offline-reference (default: the embedded model)")
    p.add_argument("--offline-dtype", default="auto",
                   help="dtype for --offline-reference (match the server's --dtype)")
    p.set_defaults(func=run)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_prompts(kind: str, n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)

    def one() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(length))

    if kind == "fixed":
        return [one()] * n
    return [one() for _ in range(n)]


def payload(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": args.output_len, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for c in chunk.get("choices") or ():
        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


async def send_one(client: Any, url: str, body: dict[str, Any]) -> RequestResult:
    res = RequestResult()
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # a failed request is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e_s = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or chunks
    res.ok = chunks > 0
    if not res.ok:
        res.error = "no tokens received"
    return res


async def discover_model(client: Any, base_url: str) -> str:
    r = await client.get(base_url + "/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def run_load(args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency or args.num_prompts,
                          max_keepalive_connections=args.concurrency or args.num_prompts)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        base = args.base_url.rstrip("/")
        model = args.model or await discover_model(client, base)
        url = base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
        prompts = make_prompts(args.prompt_kind, args.num_prompts, args.input_len, args.seed)
        sem = asyncio.Semaphore(args.concurrency or args.num_prompts)
        bar = tqdm(total=len(prompts), disable=args.no_progress, unit="req")
        rng = random.Random(args.seed + 1)

        async def limited(prompt: str) -> RequestResult:
            async with sem:
                res = await send_one(client, url, payload(args, model, prompt))
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration, model


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ms = 1000.0
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": {k: v * ms for k, v in percentiles([r.ttft_s for r in ok]).items()},
        "tpot_ms": {k: v * ms for k, v in percentiles(tpots).items()},
        "itl_ms": {k: v * ms for k, v in percentiles([x for r in ok for x in r.itl_s]).items()},
        "e2e_ms": {k: v * ms for k, v in percentiles([r.e2e_s for r in ok]).items()},
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def format_summary(s: dict[str, Any], model: str, args: argparse.Namespace) -> str:
    w = 50
    lines = [
        " Serving Benchmark Result ".center(w, "="),
        f"{'Model:':<36}{model:>14}",
        f"{'Successful requests:':<36}{s['successful_requests']:>14}",
        f"{'Failed requests:':<36}{s['failed_requests']:>14}",
        f"{'Concurrency / request rate:':<36}"
        f"{str(args.concurrency or 'inf') + ' / ' + str(args.request_rate):>14}",
        f"{'Benchmark duration (s):':<36}{s['duration_s']:>14.2f}",
        f"{'Total input tokens:':<36}{s['total_input_tokens']:>14}",
        f"{'Total generated tokens:':<36}{s['total_output_tokens']:>14}",
        f"{'Request throughput (req/s):':<36}{s['request_throughput']:>14.2f}",
        f"{'Output token throughput (tok/s):':<36}{s['output_throughput']:>14.2f}",
        f"{'Total token throughput (tok/s):':<36}{s['total_token_throughput']:>14.2f}",
    ]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append(f" {title} ".center(w, "-"))
        for stat in ("mean", "p50", "p90", "p99"):
            lines.append(f"{f'{stat} (ms):':<36}{s[key][stat]:>14.2f}")
    lines.append("=" * w)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def offline_reference(args: argparse.Namespace) -> float:
    """Output tokens/s of the same prompts straight on the engine core, no server."""
    from kvrelay.config import SchedulerConfig
    from kvrelay.core.engine import Engine
    from kvrelay.model import load_model
    from kvrelay.sampling_params import SamplingParams

    m = load_model(args.offline_model, dtype=args.offline_dtype)
    config = SchedulerConfig(
        num_blocks=m.num_blocks, block_size=m.kv_geometry.block_size,
        max_model_len=m.max_model_len, max_num_seqs=args.concurrency or 256,
    )
    engine = Engine(config, m.runner)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0,
                            ignore_eos=args.ignore_eos)
    prompts = make_prompts(args.prompt_kind, args.num_prompts, args.input_len, args.seed)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ref-{i}", m.tokenizer.encode(prompt), params,
                           eos_token_ids=m.tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> int:
    results, duration, model = asyncio.run(run_load(args))
    summary = summarize(results, duration)
    print(format_summary(summary, model, args))
    if args.offline_reference:
        ref = offline_reference(args)
        summary["offline_output_throughput"] = ref
        print(f"{'Offline engine, same prompts (tok/s):':<36}{ref:>14.2f}")
        print(f"{'Served / offline throughput:':<36}{summary['output_throughput'] / ref:>14.2f}")
    if args.save_result:
        record = {
            "model": model,
            "args": {k: _jsonable(v) for k, v in vars(args).items() if k != "func"},
            "summary": summary,
            "requests": [asdict(r) for r in results],
        }
        with open(args.save_result, "w") as f:
            json.dump(record, f, indent=2, default=str)
        print(f"saved to {args.save_result}")
    return 0 if summary["successful_requests"] else 1


def _jsonable(v: Any) -> Any:
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v
