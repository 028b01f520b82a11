"""``kvrelay bench front``: what a front (``kvrelay proxy``, and vllm-router where it is
installed) costs, in front of a stub prefill and decode engine that answers at once, in
one run.

The stub (``kvrelay.bench.front_stub``) plays P and D on two ports. The reference is no
front: the client does the hand-off itself (P's leg, then D's with P's lease), so the
stub's work is the same and what a front adds is the difference. Each front runs pinned
on one CPU; the stub and the load generator (this process) on the others. Per answer
mode (whole JSON, SSE stream) and per ``--concurrency``: ``--requests`` completions of
``--max-tokens`` tokens (or fewer, if ``--seconds`` pass first), every answer checked.
Printed per row: requests per second, latency p50/p99 and what the front adds to each
(over no front at the same concurrency), TTFT and TPOT p50 (streamed), the front's CPU
time per request (its utime + stime from /proc, all its threads); then the ratios of the
proxy over vllm-router. ``--real``: the same fronts in front of a real P/D pair of
kvrelay engines (the tiny test model of ``bench chaos``; ``--model embedded``: SmolLM2,
one torch thread each, on the load generator's CPUs) at a small streamed load: TTFT and
TPOT of each front and of none (a real D pulls the lease either way), and the rate the
pair serves (no front, the highest ``--real-concurrency``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvrelay.bench.chaos import model_args
from kvrelay.bench.front_load import Direct, Row, drive
from kvrelay.bench.front_stub import TOKEN
from kvrelay.bench.front_tables import (
    MODES,
    NO_FRONT,
    PROXY,
    ROUTER,
    goals,
    ratios,
    real_table,
    stub_table,
)
from kvrelay.bench.serve import WORDS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "front", help="kvrelay proxy and vllm-router in front of a stub P/D: rate, added "
        "latency, CPU per request", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--router", default=None, metavar="PATH",
                   help="the vllm-router binary (default: vllm-router on PATH or next to "
                   "this Python)")
    p.add_argument("--no-router", action="store_true", help="the proxy alone")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=2000, help="per row, at most")
    p.add_argument("--seconds", type=float, default=10.0, help="per row, at most")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--real", action="store_true",
                   help="also the fronts before a real P/D pair of kvrelay engines")
    p.add_argument("--model", default=None, help="--real: default the embedded model")
    p.add_argument("--real-concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--real-requests", type=int, default=24, help="--real: per row")
    p.add_argument("--real-prompt-words", type=int, default=64)
    p.add_argument("--start-timeout", type=float, default=180.0, metavar="SECONDS")
    p.set_defaults(func=run)


# -- processes --------------------------------------------------------------------------
def find_router(path: str | None) -> str | None:
    if path is not None:
        return path if Path(path).is_file() else None
    beside = Path(sys.executable).parent / "vllm-router"
    return shutil.which("vllm-router") or (str(beside) if beside.is_file() else None)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, all its threads (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split_cpus() -> tuple[set[int], set[int]]:
    """One CPU for the front, the others for the stub, engines and load generator (all
    of them for both where there is one)."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, set(cpus[1:]) or {cpus[0]})


def machine() -> str:
    model, flags = platform.processor() or "?", ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            model = value.strip()
        elif key.strip() == "Flags":
            flags = " ".join(f for f in value.split() if f.startswith(("avx", "amx", "ht")))
    return (f"{model}, {os.cpu_count()} CPUs, flags: {flags or '?'}; "
            f"Python {platform.python_version()}")


@contextmanager
def process(argv: list[str], cpus: set[int], health: str | None, timeout: float,
            log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running pinned on ``cpus`` (from before its first thread) until the block
    ends; with ``health``, once that URL answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    try:
        if health is not None:
            wait_ok(proc, health, timeout, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ok(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: its process exited ({proc.returncode}); log: {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # a process starting: nothing to wait on but its port
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s; log: {log}")


def front_argv(name: str, router: str | None, prefill: str, decode: str,
               port: int) -> list[str]:
    if name == PROXY:
        return [sys.executable, "-m", "kvrelay", "proxy", "--prefill", prefill, "--decode",
                decode, "--port", str(port), "--log-level", "warning"]
    assert router is not None
    return [router, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", prefill,
            "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]


# -- the runs ---------------------------------------------------------------------------
def measure(name: str, target: str | Direct, pid: int | None, body: dict[str, Any], mode: str,
            concurrency: int, requests: int, seconds: float, expect: str | None) -> Row:
    before = cpu_seconds(pid) if pid is not None else None
    shots, wall = asyncio.run(drive(target, body, stream=mode == "stream",
                                    concurrency=concurrency, requests=requests,
                                    seconds=seconds, expect=expect))
    cpu = cpu_seconds(pid) - before if pid is not None and before is not None else None
    return Row(name, mode, concurrency, shots, wall, cpu)


def sweep(fronts: dict[str, tuple[str, int]], direct: Direct, body: dict[str, Any],
          modes: list[str], concurrencies: list[int], requests: int, seconds: float,
          expect: str | None, warmup: int = 40) -> list[Row]:
    """Per mode and concurrency: no front first, then each front; a short warm-up each."""
    targets: list[tuple[str, str | Direct, int | None]] = [(NO_FRONT, direct, None)]
    targets += [(name, url, pid) for name, (url, pid) in fronts.items()]
    rows = []
    for mode in modes:
        for name, target, pid in targets:
            measure(name, target, pid, body, mode, 4, warmup, seconds, expect)  # warm-up
        for c in concurrencies:
            for name, target, pid in targets:
                rows.append(measure(name, target, pid, body, mode, c, requests, seconds,
                                    expect))
    return rows


def run(args: argparse.Namespace) -> int:
    from kvrelay.errors import UsageError

    if min(args.concurrency + args.real_concurrency) < 1 or args.requests < 1 \
            or args.max_tokens < 2:
        raise UsageError("--concurrency and --requests must be >= 1, --max-tokens >= 2")
    router = None if args.no_router else find_router(args.router)
    front_cpu, rest = split_cpus()
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, rest)
    try:
        return _run(args, router, front_cpu, rest)
    finally:
        # The caller's CPUs back: what this thread starts later (a test runs the bench
        # in-process, then starts engines) must not inherit the bench's narrow set.
        os.sched_setaffinity(0, mine)


def _run(args: argparse.Namespace, router: str | None, front_cpu: set[int],
         rest: set[int]) -> int:
    from kvrelay.demo import free_port

    print(f"machine: {machine()}")
    print(f"command: kvrelay {' '.join(sys.argv[1:])}")
    print(f"pinning: fronts on CPU {sorted(front_cpu)}; stub, engines and load generator on "
          f"CPU {sorted(rest)}; load: {os.getloadavg()[0]:.2f} (1 min)")
    if router is None and not args.no_router:
        print(f"vllm-router: not found ({args.router or 'PATH, and beside ' + sys.executable}):"
              " the proxy alone")
    names = [PROXY] + ([ROUTER] if router else [])
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvrelay-bench-front-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    p_port, d_port = free_port(), free_port()
    stub = [sys.executable, "-m", "kvrelay.bench.front_stub", str(p_port), str(d_port)]
    body = {"model": "stub", "prompt": "hello " * 8, "max_tokens": args.max_tokens,
            "temperature": 0.0}
    with process(stub, rest, f"http://127.0.0.1:{d_port}/health", args.start_timeout,
                 logs / "stub.log"):
        rows = with_fronts(names, router, f"http://127.0.0.1:{p_port}",
                           f"http://127.0.0.1:{d_port}", front_cpu, args, logs,
                           lambda fronts, direct: sweep(
                               fronts, direct, body, args.modes, args.concurrency,
                               args.requests, args.seconds, TOKEN * args.max_tokens))
    print(stub_table(rows))
    print(ratios(rows))
    failed = sum(len(r.shots) - len(r.ok) for r in rows)
    engine_rate = None
    if args.real:
        real_rows, engine_rate = real_run(names, router, front_cpu, rest, args, logs)
        failed += sum(len(r.shots) - len(r.ok) for r in real_rows)
    print(goals(rows, engine_rate))
    if failed:
        errors = {s.error for r in rows for s in r.shots if not s.ok}
        print(f"FAILED: {failed} requests; first errors: {sorted(errors)[:3]}; logs in {logs}")
    return 1 if failed else 0


def with_fronts(names: list[str], router: str | None, prefill: str, decode: str,
                front_cpu: set[int], args: argparse.Namespace, logs: Path,
                work: Any) -> Any:
    """``work(fronts, direct)`` with every front running, each on ``front_cpu`` (one at a
    time would leave the other idle: both run, each measured alone)."""
    from contextlib import ExitStack

    from kvrelay.demo import free_port

    fronts: dict[str, tuple[str, int]] = {}
    with ExitStack() as stack:
        for name in names:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = logs / f"{name.replace(' ', '-')}.log"
            proc = stack.enter_context(process(front_argv(name, router, prefill, decode, port),
                                               front_cpu, url + "/health",
                                               args.start_timeout, log))
            fronts[name] = (url, proc.pid)
        return work(fronts, Direct(prefill, decode))


# -- --real ------------------------------------------------------------------------------
def real_run(names: list[str], router: str | None, front_cpu: set[int], rest: set[int],
             args: argparse.Namespace, logs: Path) -> tuple[list[Row], float]:
    """The rows of every front and of none; the pair's rate (requests per second)."""
    from kvrelay.demo import Deployment, ServerProcess

    base = [*model_args(args, logs), "--dtype", "float32", "--threads", "1"]
    prefill = ServerProcess([*base, "--role", "prefill"], log_path=str(logs / "prefill.log"))
    decode = ServerProcess([*base, "--role", "decode"], log_path=str(logs / "decode.log"))
    pair = Deployment([prefill, decode])  # on this process's CPUs: rest
    try:
        pair.start(args.start_timeout)
        with urllib.request.urlopen(decode.base_url + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        rng = random.Random(0)
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0,
                "ignore_eos": True,
                "prompt": " ".join(rng.choice(WORDS) for _ in range(args.real_prompt_words))}
        rows: list[Row] = with_fronts(
            names, router, prefill.base_url, decode.base_url, front_cpu, args, logs,
            lambda fronts, direct: sweep(fronts, direct, body, ["stream"],
                                         args.real_concurrency, args.real_requests, 600.0,
                                         None, warmup=4))
    finally:
        pair.stop()
    rate = max((r.rate for r in rows if r.front == NO_FRONT), default=0.0)
    print(f"\nreal P/D ({model}, prompt {args.real_prompt_words} words, "
          f"{args.max_tokens} tokens, streamed):")
    print(real_table(rows))
    print(f"the pair's rate, no front: {rate:.2f} req/s")
    return rows, rate
