"""``kvrelay demo``: prefill + decode + proxy on localhost, a few chat requests, a table.

Every part runs as a real subprocess (``python -m kvrelay serve --role ...`` and
``python -m kvrelay proxy``) and is driven with the official ``openai`` client
through the proxy, exactly as a user would. ``--colocated`` runs one engine instead.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.errors import EXIT_FAILURE

# "Name the capital city ...": the 135M model's answer to "What is the capital of
# France?" hangs on a near tie of its first token ('The' -1.88 against 'L' -1.97 nats,
# dequantized), which the 8-bit activations of the default --quantization (gguf) flip to
# "L'Étoile, ..."; "Which city is the capital of France?" flips the same way once the
# codes serve prefill with AVX-512 VNNI ("Le Grand Château, ..."), and in bfloat16 there.
# This phrasing answers "The capital city of France is Paris." in float32 and bfloat16,
# dequantized and served as stored, AVX-512 and AVX2 (docs/model.md).
QUESTIONS = (
    "Name the capital city of France.",
    "Name three primary colors.",
    "Write one sentence about the sea.",
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="start a local server with the embedded model and chat with it",
    )
    p.add_argument("--model", default=None, help="model to serve (default: embedded model)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help="extra arguments for `kvrelay serve`, split like a shell line "
                   "(repeatable): --server-arg \"--dtype bfloat16\"")
    p.add_argument("--colocated", action="store_true",
                   help="one colocated engine instead of prefill + decode + proxy")
    p.add_argument("--kv-transport", choices=("auto", "shm", "tcp"), default="auto",
                   help="how the decode engine pulls the KV cache")
    p.set_defaults(func=run)


_handed_out: set[int] = set()  # free_port's answers so far in this process


def free_port() -> int:
    """A port for a server this process starts. Picked below the kernel's ephemeral
    range: a socket that binds port 0 meanwhile (P's relay port, any connection) can
    then never take it between this check and the server's own bind (a demo once
    failed with "address already in use" that way). Never one it gave before: two
    picks for servers not started yet (a prefill engine's HTTP and relay ports) were
    both free, and once the same (a CI run failed on it)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class ServerProcess:
    """One ``kvrelay serve`` subprocess on localhost."""

    args: list[str]
    command: str = "serve"
    port: int = field(default_factory=free_port)
    env: dict[str, str] | None = None  # default: this process's environment
    log_path: str | None = None  # where its output goes (default: inherited)
    log_level: str = "warning"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kvrelay", self.command, *self.args,
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", self.log_level]
        env = self.env if self.env is not None else os.environ.copy()
        if self.log_path is None:
            self.proc = subprocess.Popen(cmd, env=env)
            return
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not healthy within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return 0 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Deployment:
    """The processes of the demo and the URL a client talks to."""

    servers: list[ServerProcess]

    @property
    def client_url(self) -> str:
        return self.servers[-1].base_url

    def start(self, timeout: float) -> None:
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_healthy(timeout)

    def stop(self) -> list[int]:
        return [s.stop() for s in reversed(self.servers)]


def colocated(model: str | None, extra: list[str]) -> Deployment:
    return Deployment([ServerProcess(([model] if model else []) + extra)])


def disaggregated(model: str | None, extra: list[str], transport: str) -> Deployment:
    """A prefill engine, a decode engine and the proxy in front (the client's URL)."""
    base = ([model] if model else []) + extra
    prefill = ServerProcess([*base, "--role", "prefill"])
    decode = ServerProcess([*base, "--role", "decode", "--kv-transport", transport])
    proxy = ServerProcess(["--prefill", prefill.base_url, "--decode", decode.base_url],
                          command="proxy")
    return Deployment([prefill, decode, proxy])


@dataclass
class Answer:
    question: str
    text: str
    streamed: bool
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float


def ask(client: Any, model: str, question: str, max_tokens: int, stream: bool) -> Answer:
    messages = [{"role": "user", "content": question}]
    t0 = time.perf_counter()
    if not stream:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        total = time.perf_counter() - t0
        u = r.usage
        return Answer(question, r.choices[0].message.content or "", False, u.prompt_tokens,
                      u.completion_tokens, total, total)
    parts: list[str] = []
    ttft = 0.0
    usage = None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if not parts:
                    ttft = time.perf_counter() - t0
                parts.append(choice.delta.content)
                print(choice.delta.content, end="", flush=True)
    print()
    total = time.perf_counter() - t0
    return Answer(question, "".join(parts), True, usage.prompt_tokens if usage else 0,
                  usage.completion_tokens if usage else 0, ttft, total)


TRANSFER_METRICS = ("kvrelay_kv_transfer_bytes_total", "kvrelay_kv_transfer_seconds_sum")
RELEASES = tuple(f'kvrelay_leases_released_total{{reason="{r}"}}'
                 for r in ("done", "failed", "aborted", "expired"))


def print_pools(deployment: Deployment) -> None:
    roles = ("prefill", "decode") if len(deployment.servers) > 1 else ("engine",)
    for role, server in zip(roles, deployment.servers, strict=False):
        m = server_metrics(server.base_url, ("kvrelay_kv_blocks_total", "kvrelay_kv_blocks_free",
                                             "kvrelay_kv_blocks_cached", *RELEASES))
        # Cached blocks (prefix caching) are not in use: free + cached == total at rest.
        line = (f"{role}: KV blocks free {m.get('kvrelay_kv_blocks_free', 0):.0f} + cached "
                f"{m.get('kvrelay_kv_blocks_cached', 0):.0f} / "
                f"{m.get('kvrelay_kv_blocks_total', 0):.0f}")
        if role == "prefill":
            line += "; leases released: " + ", ".join(
                f"{k.split(chr(34))[1]} {m.get(k, 0):.0f}" for k in RELEASES)
        print(line)


def stats_table(answers: list[Answer], moved: list[tuple[float, ...]] | None = None) -> str:
    head = f"{'#':>2}  {'mode':<8} {'prompt':>6} {'output':>6} {'TTFT ms':>8} {'total ms':>9} " \
           f"{'tok/s':>7}"
    if moved is not None:
        head += f" {'KV bytes':>10} {'pull ms':>8}"
    rows = [head, "-" * len(head)]
    # tok/s: decode speed after the first token when streamed, else output over total.
    for i, a in enumerate(answers, 1):
        decode = a.total_s - a.ttft_s
        rate = (a.completion_tokens - 1) / decode if decode > 0 and a.completion_tokens > 1 else (
            a.completion_tokens / a.total_s if a.total_s else 0.0
        )
        ttft = f"{a.ttft_s * 1e3:.0f}" if a.streamed else "-"  # unknown unless streamed
        row = (f"{i:>2}  {'stream' if a.streamed else 'full':<8} {a.prompt_tokens:>6} "
               f"{a.completion_tokens:>6} {ttft:>8} {a.total_s * 1e3:>9.0f} {rate:>7.1f}")
        if moved is not None:
            row += f" {moved[i - 1][0]:>10.0f} {moved[i - 1][1] * 1e3:>8.1f}"
        rows.append(row)
    return "\n".join(rows)


def server_metrics(base_url: str, names: tuple[str, ...]) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        # Engine series carry model_name, transfers their transport; the names asked
        # for leave them out (summed over them).
        name = re.sub(r'(model_name|transport)="[^"]*",?', "", name).replace(
            "{}", "").replace(",}", "}")
        if name in names:
            values[name] = values.get(name, 0.0) + float(value)
    return values


def server_args(model: str | None, values: list[str]) -> list[str]:
    """``--server-arg`` values split like a shell line, checked against `kvrelay serve`'s
    own parser here, so a mistake is one line now and not a server that never starts."""
    from kvrelay.errors import UsageError
    from kvrelay.server.cli import add_cache_args, add_model_args, add_role_args, add_server_args

    extra = [word for v in values for word in shlex.split(v)]
    serve = argparse.ArgumentParser(prog="kvrelay serve", add_help=False, exit_on_error=False)
    add_model_args(serve)
    add_cache_args(serve)
    add_server_args(serve)
    add_role_args(serve)
    try:
        parsed, unknown = serve.parse_known_args(([model] if model else []) + extra)
    except argparse.ArgumentError as exc:
        raise UsageError(f"--server-arg: {exc}") from exc
    if unknown:
        raise UsageError(f"--server-arg: `kvrelay serve` has no argument {unknown[0]!r}")
    if parsed.model is not None and not Path(parsed.model).exists():
        raise UsageError(f"model path {parsed.model} does not exist")
    return extra


def run(args: argparse.Namespace) -> int:
    import openai

    extra = server_args(args.model, args.server_arg)
    if args.colocated:
        deployment = colocated(args.model, extra)
        print("starting the server (loading the model)...", flush=True)
    else:
        deployment = disaggregated(args.model, extra, args.kv_transport)
        print("starting a prefill engine, a decode engine and the proxy...", flush=True)
    t0 = time.perf_counter()
    try:
        try:
            deployment.start(args.startup_timeout)
        except (RuntimeError, TimeoutError) as exc:
            print(f"kvrelay demo: the server did not come up: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        print(f"server ready at {deployment.client_url} in {time.perf_counter() - t0:.1f} s\n")
        client = openai.OpenAI(base_url=deployment.client_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        decode_url = deployment.servers[1 if len(deployment.servers) > 1 else 0].base_url
        answers, moved = [], []
        for i, q in enumerate(QUESTIONS):
            stream = i == 0
            before = server_metrics(decode_url, TRANSFER_METRICS)
            print(f"Q: {q}\nA: ", end="", flush=True)
            a = ask(client, model, q, args.max_tokens, stream)
            after = server_metrics(decode_url, TRANSFER_METRICS)
            moved.append(tuple(after.get(k, 0.0) - before.get(k, 0.0) for k in TRANSFER_METRICS))
            if not stream:
                print(a.text.strip())
            print()
            answers.append(a)
        print(f"model: {model}\n")
        print(stats_table(answers, None if args.colocated else moved))
        print_pools(deployment)
    finally:
        codes = deployment.stop()
    if any(codes):
        print(f"a server exited with status {codes}", file=sys.stderr)
        return EXIT_FAILURE
    return 0
