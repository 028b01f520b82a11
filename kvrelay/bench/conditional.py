"""``kvrelay bench conditional``: conditional disaggregation against always-disaggregated
and always-local prefill, on 1P1D behind the proxy, in one run.

One cluster per mode, all started at once (``--disaggregation always``, the reference,
then ``never``, then ``conditional`` with ``--local-prefill-queue-tokens`` and each
``--local-prefill-max-tokens`` value given, so that one run tunes it): one prefill and
one decode engine (embedded model by default, bfloat16 where native, one thread each)
and the proxy. Each engine gets one short warm-up request straight. Then the same
``--num-requests`` streamed completions go through each proxy at ``--concurrency``, in
one seeded order: a ``--long-fraction`` of them long (one of ``--num-prefixes`` shared
documents of ``--prefix-len`` common words, about a token each, then a question of
``--tail-len`` words), the rest short (a question of 4 to ``--short-len`` words,
uniformly). The requests run in rounds of ``ROUND``, each round through every cluster in
turn, so that the load of a shared machine weighs on every mode alike. Printed per mode:
TTFT p50, p90 and p99 as the client sees it, the end-to-end mean, the bytes the decode
engine pulled and where the proxy placed each prefill (its routing reasons); last, each
conditional run's TTFT p50 and p99 over the better of the two others at each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.bench.routing import (
    add_engine_args,
    load,
    proxy_sees_all_healthy,
    scrape,
    warm_up,
)
from kvrelay.bench.serve import WORDS, RequestResult, percentiles
from kvrelay.proxy.placement import PlacementConfig

MODES = ("always", "never", "conditional")  # the reference first
LABELS = {"always": "always-disaggregated", "never": "always-local"}
ROUND = 16  # requests per mode per round (interleaved)


def register(subparsers: Any) -> None:
    d = PlacementConfig()
    p = subparsers.add_parser(
        "conditional", help="conditional disaggregation vs always-disaggregated and "
        "always-local prefill on 1P1D (mixed short and long prompts)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--long-fraction", type=float, default=0.5)
    p.add_argument("--num-prefixes", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=512, help="shared document, words")
    p.add_argument("--tail-len", type=int, default=16, help="a long prompt's question, words")
    p.add_argument("--short-len", type=int, default=160,
                   help="a short prompt's most words (each has 4 to this many)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--local-prefill-max-tokens", type=int, nargs="+", default=[d.max_tokens],
                   metavar="N", help="one conditional run per value")
    p.add_argument("--local-prefill-queue-tokens", type=int, default=d.queue_tokens,
                   metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS")
    p.add_argument("--save-result", metavar="FILE.json",
                   help="every request of every mode: its kind, when it was sent, TTFT, E2E")
    p.set_defaults(func=run)


def make_prompts(args: argparse.Namespace) -> list[str]:
    """The mixed workload, in one seeded order (the same for every mode)."""
    rng = random.Random(args.seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    docs = [f"Document {j}: {words(args.prefix_len)}" for j in range(args.num_prefixes)]
    out = []
    for i in range(args.num_requests):
        if rng.random() < args.long_fraction:
            out.append(f"{rng.choice(docs)}\nQuestion {i}: {words(args.tail_len)}")
        else:
            out.append(f"Question {i}: {words(rng.randint(4, max(4, args.short_len)))}")
    return out


def kinds(prompts: list[str]) -> list[str]:
    """Each prompt's kind: ``short``; ``cold``, the first on its document (no engine holds
    it); ``warm``, a later one (the engine that served the first may hold it)."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        doc = p.split("\nQuestion", 1)[0] if p.startswith("Document") else ""
        out.append("short" if not doc else "warm" if doc in seen else "cold")
        seen.add(doc)
    return out


@dataclass
class Outcome:
    mode: str
    max_tokens: int  # --local-prefill-max-tokens (conditional)
    results: list[RequestResult]
    reasons: dict[str, float]  # 'role/reason' -> picks
    pulled: float  # bytes the decode engine pulled
    sent: list[float] = field(default_factory=list)  # s from its round's start, per request

    def ttft(self) -> dict[str, float]:
        return percentiles([r.ttft_s * 1e3 for r in self.results if r.ok])


def run(args: argparse.Namespace) -> int:
    from kvrelay.errors import UsageError
    from kvrelay.model.loader import concrete_dtype

    args.dtype = concrete_dtype(args.dtype, args.model, getattr(args, "device", "cpu"))
    if args.num_requests < 1 or args.concurrency < 1 or args.num_prefixes < 1:
        raise UsageError("--num-requests, --concurrency and --num-prefixes must be >= 1")
    if not 0.0 <= args.long_fraction <= 1.0:
        raise UsageError(f"--long-fraction must be between 0 and 1, got {args.long_fraction}")
    try:
        for n in args.local_prefill_max_tokens:
            PlacementConfig("conditional", n, args.local_prefill_queue_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    prompts = make_prompts(args)
    runs = [(m, args.local_prefill_max_tokens[0]) for m in MODES[:2]] + [
        ("conditional", n) for n in args.local_prefill_max_tokens]
    clusters: list[Cluster] = []
    try:
        for mode, n in runs:  # each one's ports taken just before it starts
            clusters.append(Cluster(args, mode, n))
            clusters[-1].start()
        outcomes = interleaved(args, clusters, prompts)
    except Exception:
        print("a cluster failed; the logs are in " + ", ".join(str(c.logs) for c in clusters))
        raise
    finally:
        for c in clusters:
            c.deployment.stop()
    print(report(args, outcomes))
    print(tails(prompts, outcomes))
    if args.save_result:
        save(args.save_result, prompts, outcomes)
    return 1 if any(not r.ok for o in outcomes for r in o.results) else 0


class Cluster:
    """1P1D and a proxy with ``--disaggregation mode``."""

    def __init__(self, args: argparse.Namespace, mode: str, max_tokens: int) -> None:
        from kvrelay.demo import Deployment, ServerProcess

        self.args, self.mode, self.max_tokens = args, mode, max_tokens
        base = ([args.model] if args.model else []) + [
            "--dtype", args.dtype, "--threads", str(args.threads)]
        self.logs = Path(tempfile.mkdtemp(prefix=f"kvrelay-bench-conditional-{mode}-"))
        self.p = ServerProcess([*base, "--role", "prefill"],
                               log_path=str(self.logs / "prefill.log"))
        self.d = ServerProcess([*base, "--role", "decode"],
                               log_path=str(self.logs / "decode.log"))
        self.proxy = ServerProcess(
            ["--prefill", self.p.base_url, "--decode", self.d.base_url, "--disaggregation",
             mode, "--local-prefill-max-tokens", str(max_tokens),
             "--local-prefill-queue-tokens", str(args.local_prefill_queue_tokens)],
            command="proxy", log_path=str(self.logs / "proxy.log"))
        self.deployment = Deployment([self.p, self.d, self.proxy])
        self.model = ""
        self.pulled0 = 0.0

    def start(self) -> None:
        self.deployment.start(self.args.start_timeout)
        self.model = asyncio.run(warm_up([self.p.base_url, self.d.base_url]))
        proxy_sees_all_healthy(self.proxy.base_url, 2, self.args.start_timeout)
        self.pulled0 = pulled_bytes(self.d.base_url)

    def outcome(self, results: list[RequestResult], sent: list[float]) -> Outcome:
        reasons = {}
        for key, value in scrape(self.proxy.base_url).items():
            if key.startswith("kvrelay_proxy_route_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
                reasons[f"{labels['role']}/{labels['reason']}"] = value
        return Outcome(self.mode, self.max_tokens, results, reasons,
                       pulled_bytes(self.d.base_url) - self.pulled0, sent)


def interleaved(args: argparse.Namespace, clusters: list[Cluster],
                prompts: list[str]) -> list[Outcome]:
    """The prompts in rounds of ``ROUND`` requests, each round through every cluster in
    turn (the order rotating): a machine whose load drifts during the run (a shared one)
    slows every mode alike, not the one that happened to run then."""
    results: list[list[RequestResult]] = [[] for _ in clusters]
    sent: list[list[float]] = [[] for _ in clusters]
    for r, start in enumerate(range(0, len(prompts), ROUND)):
        chunk = prompts[start:start + ROUND]
        for k in range(len(clusters)):
            i = (k + r) % len(clusters)
            c = clusters[i]
            timed = asyncio.run(load(c.proxy.base_url, c.model, chunk, args))
            results[i] += [res for _, res in timed]
            sent[i] += [t for t, _ in timed]
    return [c.outcome(res, t) for c, res, t in zip(clusters, results, sent, strict=True)]


def pulled_bytes(url: str) -> float:
    return sum(v for k, v in scrape(url).items()
               if k.split("{")[0] == "kvrelay_kv_transfer_bytes_total")


def report(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    longs = round(args.long_fraction * 100)
    lines = [
        f"workload: 1P1D, {args.num_requests} streamed requests, ~{longs}% long (one of "
        f"{args.num_prefixes} documents of {args.prefix_len} words + {args.tail_len}-word "
        f"question), the rest 4-{args.short_len} words; concurrency {args.concurrency}, "
        f"max_tokens {args.output_len}; {args.dtype}, {args.threads} thread(s) per engine; "
        f"conditional: --local-prefill-queue-tokens {args.local_prefill_queue_tokens}",
        f"{'mode':<22}{'ok':>4}{'TTFT p50 ms':>13}{'p90 ms':>9}{'p99 ms':>9}"
        f"{'E2E mean ms':>13}{'pulled MiB':>12}  prefill placed by",
    ]
    ttft = [o.ttft() for o in outcomes]
    for o, t in zip(outcomes, ttft, strict=True):
        ok = [r for r in o.results if r.ok]
        e2e = percentiles([r.e2e_s * 1e3 for r in ok])["mean"] if ok else 0.0
        why = ", ".join(f"{k.split('/', 1)[1]} {v:.0f}" for k, v in sorted(o.reasons.items())
                        if v and k.startswith("prefill/"))
        label = f"conditional {o.max_tokens}" if o.mode == "conditional" else LABELS[o.mode]
        lines.append(f"{label:<22}{len(ok):>4}{t['p50']:>13.1f}{t['p90']:>9.1f}"
                     f"{t['p99']:>9.1f}{e2e:>13.1f}{o.pulled / 2**20:>12.1f}  {why or '-'}")
        errors = sorted({r.error for r in o.results if not r.ok})[:3]
        if errors:
            lines.append(f"  errors: {'; '.join(errors)}")
    for o, t in zip(outcomes[2:], ttft[2:], strict=True):
        ratios = [f"{q} {t[q] / best:.3f}" for q in ("p50", "p99")
                  if (best := min(ttft[0][q], ttft[1][q]))]
        lines.append(f"TTFT ratio conditional {o.max_tokens} / better of the two: "
                     f"{', '.join(ratios)}")
    return "\n".join(lines)


def _label(o: Outcome) -> str:
    return f"conditional {o.max_tokens}" if o.mode == "conditional" else LABELS[o.mode]


def tails(prompts: list[str], outcomes: list[Outcome]) -> str:
    """TTFT by prompt kind (kinds()) per mode, and the kinds of each mode's slowest
    requests (past its p95): what makes the tail."""
    kind = kinds(prompts)
    lines = [f"{'TTFT by kind':<22}" + "".join(
        f"{k + ' n/p50/max ms':>26}" for k in ("short", "cold", "warm")) + "  slowest (>p95)"]
    for o in outcomes:
        cells = []
        for k in ("short", "cold", "warm"):
            t = [r.ttft_s * 1e3 for r, kk in zip(o.results, kind, strict=True)
                 if r.ok and kk == k]
            cells.append(f"{len(t)}/{percentiles(t)['p50']:.0f}/{max(t, default=0):.0f}")
        ok = sorted(((r.ttft_s * 1e3, i) for i, r in enumerate(o.results) if r.ok),
                    reverse=True)
        slow = ok[:max(1, len(ok) // 20)]
        lines.append(f"{_label(o):<22}" + "".join(f"{c:>26}" for c in cells) + "  " +
                     ", ".join(f"#{i} {kind[i]} {t:.0f}" for t, i in slow))
    return "\n".join(lines)


def save(path: str, prompts: list[str], outcomes: list[Outcome]) -> None:
    kind = kinds(prompts)
    rows = [{"mode": _label(o), "i": i, "round": i // ROUND, "kind": kind[i],
             "chars": len(prompts[i]), "sent_s": o.sent[i] if i < len(o.sent) else None,
             "ok": r.ok, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
             "prompt_tokens": r.prompt_tokens}
            for o in outcomes for i, r in enumerate(o.results)]
    Path(path).write_text(json.dumps({"requests": rows, "reasons": {
        _label(o): o.reasons for o in outcomes}}, indent=1))
