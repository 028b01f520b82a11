"""``kvrelay bench chaos``: an abort storm on 1P1D behind the proxy, and the recovery.

A prefill engine, a decode engine and the proxy start as real processes on localhost
(a tiny random model by default, ``--model embedded`` for the embedded SmolLM2-135M).
``--concurrency`` clients stream completions through the proxy without a pause, one
after another: ``--warmup`` seconds left out of the figures, ``--before`` seconds of
steady load, then ``--storm`` seconds in
which each new request leaves, with probability ``--abort-fraction``, at one of three
moments picked at random: while it waits for P (after a random delay shorter than the
before-phase TTFT, before its first token), during the KV pull (right after its first
token) or during decode (after 2 to 4 tokens); then ``--after`` seconds of steady
load again. Every loop is bounded by its phase's end and by ``--max-requests``.

Printed: output throughput (tokens the clients received per second) and TTFT p50/p99
of each phase; the time to recover (the end of the first ``--window`` after the storm
whose throughput is within 5% of the before phase's); the most KV blocks in use,
running requests and leases held at any moment on P and D (their /metrics sampled
every ``--sample-interval`` during the whole run); and the ledger once the load has
stopped: P's leases by outcome, leases still held, and whether every pool is whole.
The goal: back within 5% of the before-throughput within two lease timeouts, nothing
held past its bound (every lease ended and every pool whole within one lease timeout
of the last request).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.bench.routing import proxy_sees_all_healthy, scrape, warm_up
from kvrelay.bench.serve import WORDS, percentiles

PHASES = ("before", "storm", "after")
LEAVE_KINDS = ("wait_p", "pull", "decode")  # the moment a storm client leaves
RECOVERED = 0.95  # a window within 5% of the before-throughput
LEASE_OUTCOMES = ("done", "failed", "aborted", "expired")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chaos", help="an abort storm on 1P1D through the proxy: throughput, TTFT, recovery",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None,
                   help="a model path, or 'embedded' for the embedded SmolLM2-135M "
                   "(default: a tiny random model written to a temporary directory)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per engine")
    p.add_argument("--lease-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="both engines' --lease-timeout")
    p.add_argument("--concurrency", type=int, default=4, help="clients in flight")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                   help="steady load before the before phase, left out of the figures")
    p.add_argument("--before", type=float, default=12.0, metavar="SECONDS")
    p.add_argument("--storm", type=float, default=8.0, metavar="SECONDS")
    p.add_argument("--after", type=float, default=14.0, metavar="SECONDS")
    p.add_argument("--abort-fraction", type=float, default=0.75,
                   help="share of storm requests whose client leaves")
    p.add_argument("--leave", nargs="+", choices=LEAVE_KINDS, default=list(LEAVE_KINDS),
                   help="the moments a storm client may leave at (to tell which one "
                   "leaves leases behind)")
    p.add_argument("--window", type=float, default=2.0, metavar="SECONDS",
                   help="throughput window for the time to recover")
    p.add_argument("--sample-interval", type=float, default=0.2, metavar="SECONDS")
    p.add_argument("--max-requests", type=int, default=5000, help="bound on all requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS")
    p.set_defaults(func=run)


@dataclass
class Shot:
    """One request as its client saw it (times from the run's start)."""

    phase: str
    start: float
    tokens: list[float] = field(default_factory=list)  # arrival time of each token
    left: str | None = None  # the moment the client left (LEAVE_KINDS), if it did
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.tokens[0] - self.start if self.tokens else None


@dataclass
class Peaks:
    """The most held at any sampled moment, per engine role."""

    blocks: dict[str, float] = field(default_factory=dict)  # in use (not free or cached)
    total: dict[str, float] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    def add(self, role: str, m: dict[str, float]) -> None:
        total, back = blocks(m)
        self.total[role] = total
        running = value(m, "kvrelay_requests_running")
        for into, v in ((self.blocks, total - back), (self.running, running),
                        (self.leases, held_leases(m))):
            into[role] = max(into.get(role, 0.0), v)


@dataclass
class Ledger:
    released: dict[str, float]  # P's leases released during the run, by outcome
    made: float  # P's leases created during the run (kvrelay_leases_created_total)
    held: float  # leases still held on P
    fallbacks: dict[str, float]  # D's pulls that ended without remote KV, by reason
    whole: dict[str, bool]  # role -> every block free or cached
    settle_s: float | None  # load stopped -> everything whole (None: not within the bound)

    @property
    def balanced(self) -> bool:
        """Every lease made ended exactly once and every pool whole, within the bound."""
        return (self.held == 0 and sum(self.released.values()) == self.made
                and all(self.whole.values()) and self.settle_s is not None)


def value(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest.rstrip("}").split(",") for w in want):
            total += v
    return total


def blocks(m: dict[str, float]) -> tuple[float, float]:
    """(total, free + cached): equal when nothing holds a block."""
    back = value(m, "kvrelay_kv_blocks_free") + value(m, "kvrelay_kv_blocks_cached")
    return value(m, "kvrelay_kv_blocks_total"), back


def held_leases(m: dict[str, float]) -> float:
    return value(m, "kvrelay_leases", state="held") + value(m, "kvrelay_leases", state="pulling")


def run(args: argparse.Namespace) -> int:
    from kvrelay.errors import UsageError

    if args.concurrency < 1 or args.max_requests < 1 or args.output_len < 5:
        raise UsageError("--concurrency and --max-requests must be >= 1, --output-len >= 5 "
                         "(a decode-phase client leaves after 2 to 4 tokens)")
    if min(args.before, args.storm, args.after, args.window, args.sample_interval) <= 0:
        raise UsageError("--before, --storm, --after, --window and --sample-interval "
                         "must be > 0")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: allowed >= 0")
    if not 0.0 <= args.abort_fraction <= 1.0:
        raise UsageError(f"--abort-fraction {args.abort_fraction}: allowed 0 to 1")
    logs = Path(tempfile.mkdtemp(prefix="kvrelay-bench-chaos-"))
    shots, peaks, ledger = storm_on_1p1d(args, logs)
    print(report(args, shots, peaks, ledger))
    steady_failed = [s for s in shots if s.phase != "storm" and s.error]
    return 0 if ledger.balanced and not steady_failed else 1


def model_args(args: argparse.Namespace, logs: Path) -> list[str]:
    if args.model == "embedded":
        return []
    if args.model:
        return [args.model]
    from kvrelay.testing.models import write_tiny_hf_model

    return [str(write_tiny_hf_model(logs / "tiny-model"))]


def storm_on_1p1d(args: argparse.Namespace,
                  logs: Path) -> tuple[list[Shot], Peaks, Ledger]:
    from kvrelay.demo import Deployment, ServerProcess

    base = [*model_args(args, logs), "--dtype", args.dtype, "--threads", str(args.threads),
            "--num-blocks", str(args.num_blocks), "--lease-timeout", str(args.lease_timeout)]
    prefill = ServerProcess([*base, "--role", "prefill"], log_path=str(logs / "prefill.log"))
    decode = ServerProcess([*base, "--role", "decode"], log_path=str(logs / "decode.log"))
    proxy = ServerProcess(["--prefill", prefill.base_url, "--decode", decode.base_url],
                          command="proxy", log_path=str(logs / "proxy.log"))
    engines = {"P": prefill.base_url, "D": decode.base_url}
    cluster = Deployment([prefill, decode, proxy])
    try:
        cluster.start(args.start_timeout)
        model = asyncio.run(warm_up(list(engines.values())))
        proxy_sees_all_healthy(proxy.base_url, 2, args.start_timeout)
        start = {role: scrape(url) for role, url in engines.items()}
        peaks, stop = Peaks(), threading.Event()
        sampler = threading.Thread(target=sample_until, args=(engines, peaks, stop, args),
                                   daemon=True)
        sampler.start()
        try:
            shots = asyncio.run(drive(proxy.base_url, model, args))
            ledger = settle(engines, start, args.lease_timeout)
        finally:
            stop.set()
            sampler.join(30)
    except Exception:
        print(f"the chaos cluster failed; its logs are in {logs}")
        raise
    finally:
        cluster.stop()
    return shots, peaks, ledger


def sample_until(engines: dict[str, str], peaks: Peaks, stop: threading.Event,
                 args: argparse.Namespace) -> None:
    """The sampler thread: a scrape that fails is a missed sample, never the run's end."""
    while not stop.wait(args.sample_interval):
        for role, url in engines.items():
            try:
                peaks.add(role, scrape(url))
            except Exception:  # an engine busy past the scrape timeout: try again next tick
                continue
        peaks.samples += 1


def settle(engines: dict[str, str], start: dict[str, dict[str, float]],
           lease_timeout: float) -> Ledger:
    """Wait (one lease timeout at most) until every pool is whole and no lease is held;
    the ledger then."""
    t0 = time.monotonic()
    settle_s = None
    while True:
        now = {role: scrape(url) for role, url in engines.items()}
        whole = {role: blocks(m)[0] == blocks(m)[1] for role, m in now.items()}
        held = held_leases(now["P"])
        if held == 0 and all(whole.values()):
            settle_s = time.monotonic() - t0
            break
        if time.monotonic() - t0 > lease_timeout:
            break
        time.sleep(0.05)
    p, start_p = now["P"], start["P"]
    released = {o: value(p, "kvrelay_leases_released_total", reason=o)
                - value(start_p, "kvrelay_leases_released_total", reason=o)
                for o in LEASE_OUTCOMES}
    made = (value(p, "kvrelay_leases_created_total")
            - value(start_p, "kvrelay_leases_created_total"))
    return Ledger(released, made, held, fallbacks(now["D"], start["D"]), whole, settle_s)


def fallbacks(now: dict[str, float], start: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m, sign in ((now, 1.0), (start, -1.0)):
        for key, v in m.items():
            if key.startswith("kvrelay_kv_load_fallbacks_total{"):
                reason = re.search(r'reason="([^"]*)"', key)
                if reason:
                    out[reason[1]] = out.get(reason[1], 0.0) + sign * v
    return {k: v for k, v in sorted(out.items()) if v}


def phase_at(t: float, args: argparse.Namespace) -> str | None:
    if t < 0:
        return "warmup"
    if t < args.before:
        return "before"
    if t < args.before + args.storm:
        return "storm"
    if t < args.before + args.storm + args.after:
        return "after"
    return None


async def drive(url: str, model: str, args: argparse.Namespace) -> list[Shot]:
    """``--concurrency`` closed-loop clients through every phase; each stops at the end
    of the last phase or when ``--max-requests`` have started."""
    import httpx

    rng = random.Random(args.seed)
    shots: list[Shot] = []
    tls = ssl.create_default_context()  # once: each client of its own would load the CAs
    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    t0 = time.perf_counter() + args.warmup  # the before phase starts at 0
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as client:
        async def client_loop() -> None:
            while len(shots) < args.max_requests:
                phase = phase_at(time.perf_counter() - t0, args)
                if phase is None:
                    return
                leave = pick_leave(phase, shots, rng, args)
                shot = Shot(phase, time.perf_counter() - t0)
                shots.append(shot)
                payload = body(model, rng, args)
                if leave is None:
                    await stream_one(client, url + "/v1/completions", payload, shot, None, t0)
                    continue
                # A client that leaves gets a connection of its own: httpx's pool leaks
                # the slot of a request cancelled while it connects (httpcore 1.0.9,
                # encode/httpcore#1093), and after a few hundred departures every
                # client would wait on the pool instead of the cluster.
                async with httpx.AsyncClient(timeout=120.0, verify=tls) as own:
                    await stream_one(own, url + "/v1/completions", payload, shot, leave, t0)

        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    return shots


def pick_leave(phase: str, shots: list[Shot], rng: random.Random,
               args: argparse.Namespace) -> tuple[str, float] | None:
    """(kind, when) for a storm client that leaves: when is a delay in seconds for
    wait_p (shorter than the before phase's TTFT p50), a token count otherwise."""
    if phase != "storm" or rng.random() >= args.abort_fraction:
        return None
    kind = rng.choice(args.leave)
    if kind == "wait_p":
        ttfts = [t for s in shots if s.phase == "before" and (t := s.ttft_s) is not None]
        return kind, rng.uniform(0.0, percentiles(ttfts)["p50"] or 0.05)
    return kind, 1.0 if kind == "pull" else float(rng.randint(2, 4))


def body(model: str, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    return {"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(args.input_len)),
            "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True}


async def stream_one(client: Any, url: str, payload: dict[str, Any], shot: Shot,
                     leave: tuple[str, float] | None, t0: float) -> None:
    """Stream one completion; a leaving client closes its connection at its moment (the
    proxy sees a disconnect). What it saw goes into ``shot``."""
    wait_p = leave is not None and leave[0] == "wait_p"
    tokens_then_leave = leave[1] if leave is not None and not wait_p else None
    try:
        async with asyncio.timeout(leave[1] if leave is not None and wait_p else None):
            async with client.stream("POST", url, json=payload) as r:
                if r.status_code != 200:
                    shot.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                    return
                async for line in r.aiter_lines():
                    if await _token(line, shot, t0) and (
                            wait_p or len(shot.tokens) == tokens_then_leave):
                        shot.left = leave_kind(shot)  # a wait_p client whose token came first
                        return
    except TimeoutError:
        if wait_p:
            shot.left = leave_kind(shot)
            return
        shot.error = "TimeoutError"
    except Exception as exc:  # a failed request is counted, never the run's end
        shot.error = f"{type(exc).__name__}: {exc}"
        return
    if not shot.tokens and not shot.error:
        shot.error = "no tokens received"


async def _token(line: str, shot: Shot, t0: float) -> bool:
    """Record a token chunk of the SSE stream; raise on an error event."""
    import json

    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return False
    chunk = json.loads(line[5:])
    if "error" in chunk:
        raise RuntimeError(str(chunk["error"])[:200])
    if not chunk.get("choices"):
        return False
    shot.tokens.append(time.perf_counter() - t0)
    return True


def leave_kind(shot: Shot) -> str:
    """The phase the request was in when its client left, from the tokens it had."""
    return LEAVE_KINDS[min(len(shot.tokens), 2)]


def phase_stats(shots: list[Shot], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    bounds = {"before": (0.0, args.before),
              "storm": (args.before, args.before + args.storm),
              "after": (args.before + args.storm, args.before + args.storm + args.after)}
    out = {}
    for phase, (lo, hi) in bounds.items():
        toks = sum(lo <= t < hi for s in shots for t in s.tokens)
        ttft = percentiles([t * 1e3 for s in shots if s.phase == phase
                            and (t := s.ttft_s) is not None])
        out[phase] = {"tok_s": toks / (hi - lo), "p50": ttft["p50"], "p99": ttft["p99"],
                      "requests": float(sum(s.phase == phase for s in shots))}
    return out


def windows(shots: list[Shot], args: argparse.Namespace) -> list[float]:
    """Throughput (tok/s) of each whole ``--window`` of the run, from its start."""
    end = args.before + args.storm + args.after
    counts = [0] * int(end // args.window)
    for s in shots:
        for t in s.tokens:
            if t >= 0 and (k := int(t // args.window)) < len(counts):
                counts[k] += 1
    return [c / args.window for c in counts]


def time_to_recover(rates: list[float], before_tok_s: float,
                    args: argparse.Namespace) -> float | None:
    """Seconds from the storm's end to the end of the first window that starts after it
    and is within 5% of the before-throughput (None: none in the after phase)."""
    storm_end = args.before + args.storm
    for k, rate in enumerate(rates):
        if k * args.window >= storm_end and rate >= RECOVERED * before_tok_s:
            return (k + 1) * args.window - storm_end
    return None


def report(args: argparse.Namespace, shots: list[Shot], peaks: Peaks, ledger: Ledger) -> str:
    stats = phase_stats(shots, args)
    before = stats["before"]["tok_s"]
    rates = windows(shots, args)
    recover = time_to_recover(rates, before, args)
    left = {k: sum(s.left == k for s in shots) for k in LEAVE_KINDS}
    failed = {p: sum(bool(s.error) for s in shots if s.phase == p) for p in PHASES}
    lines = [
        f"workload: 1P1D + proxy, {args.concurrency} streamed clients, {args.input_len}-word "
        f"prompts, max_tokens {args.output_len}; {args.before:g} s steady, {args.storm:g} s "
        f"storm ({args.abort_fraction:.0%} of clients leave), {args.after:g} s steady; "
        f"lease timeout {args.lease_timeout:g} s, {args.num_blocks} KV blocks per engine",
        f"{'phase':<8}{'requests':>9}{'failed':>7}{'tok/s':>9}{'vs before':>10}"
        f"{'TTFT p50 ms':>13}{'p99 ms':>9}",
    ]
    for phase in PHASES:
        s = stats[phase]
        ratio = s["tok_s"] / before if before else 0.0
        lines.append(f"{phase:<8}{s['requests']:>9.0f}{failed[phase]:>7}{s['tok_s']:>9.1f}"
                     f"{ratio:>10.3f}{s['p50']:>13.1f}{s['p99']:>9.1f}")
    lines.append("clients that left: " + ", ".join(f"{k} {v}" for k, v in left.items()))
    lines.append(f"tok/s by {args.window:g} s window: " + " ".join(f"{r:.0f}" for r in rates))
    lines.append("time to recover: " + (f"{recover:.1f} s" if recover is not None else
                                        f"not within the {args.after:g} s after the storm")
                 + f" (window {args.window:g} s; two lease timeouts = "
                 f"{2 * args.lease_timeout:g} s)")
    lines.append(f"{'most held':<10}{'KV blocks':>16}{'running':>9}{'leases':>8}"
                 f"   ({peaks.samples} samples)")
    for role in ("P", "D"):
        held_blocks = f"{peaks.blocks.get(role, 0):.0f} of {peaks.total.get(role, 0):.0f}"
        lines.append(f"{role:<10}{held_blocks:>16}{peaks.running.get(role, 0):>9.0f}"
                     + (f"{peaks.leases.get(role, 0):>8.0f}" if role == "P" else f"{'-':>8}"))
    outcomes = ", ".join(f"{o} {v:.0f}" for o, v in ledger.released.items())
    whole = ", ".join(f"{r} {'whole' if w else 'NOT whole'}" for r, w in ledger.whole.items())
    lines.append(f"ledger: P leases released {sum(ledger.released.values()):.0f} ({outcomes}) "
                 f"of {ledger.made:.0f} created; "
                 f"{ledger.held:.0f} still held; pools {whole}"
                 + (f" {ledger.settle_s:.2f} s after the last request"
                    if ledger.settle_s is not None else
                    f", not within one lease timeout ({args.lease_timeout:g} s)"))
    lines.append(f"ledger balanced (every lease created ended once, every pool whole): "
                 f"{'yes' if ledger.balanced else 'NO'}")
    lines.append(f"leases held until they expired: {ledger.released['expired']:.0f}; "
                 "D's pulls that fell back: "
                 + (", ".join(f"{k} {v:.0f}" for k, v in ledger.fallbacks.items()) or "none"))
    held = recover is not None and recover <= 2 * args.lease_timeout and ledger.balanced
    lines.append("goal (back within 5% of the before-throughput within two lease timeouts, "
                 f"nothing held past its bound): {'held' if held else 'NOT held'}")
    return "\n".join(lines)
