"""``kvrelay bench soak``: hours-like mixed load on 1P1D with faults on a schedule.

A prefill engine, a decode engine, the proxy and a colocated float32 reference engine
start as real processes (a tiny random model by default). With root and ``ip netns``
(``--netns auto``), P runs in its own network namespace joined to the others' by a veth
pair (kvrelay.bench.netns): the proxy reaches P and D pulls over tcp across that link,
and a partition is the link going down; without them the partition is skipped with the
reason printed and everything runs on 127.0.0.1 (D pulls over shm).

``--concurrency`` clients send, without a pause, a mix of completions and chats, streamed
or not, with ``max_tokens`` from 1 to 24 and prompts that share prefixes; ``--leave-
fraction`` of them leave after their first chunk. Every ``--fault-every-s`` the next
fault of the cycle strikes: SIGSTOP/SIGCONT of P, of D (``--stop-s``), a partition of P's
link (``--partition-s``), a restart of the proxy (kill -9, started again on its port),
kill -9 and restart of D, of P. Every text that arrives whole is compared with the
reference engine's for the same request (greedy, float32).

Printed: requests ok / failed / wrong (failures by cause: each one an error the client
saw; ``hung`` and ``silent`` would be ones it did not), the faults done, and every
``--sample-every-s`` each process's RSS, open fds and threads with P's live leases and
lease tombstones, D's loads in flight and relay peers, the proxy's outstanding requests;
then first vs last sample after ``--warmup-s`` per role (a restarted process is a new
life: its pid is shown). The goal: 0 wrong texts, every failure seen by its client, every
resource flat after warm-up, every pool whole at the end. Not a CI test: its short run is
tests/e2e/test_bench_soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.bench.chaos import blocks, held_leases, model_args, value
from kvrelay.bench.routing import scrape
from kvrelay.bench.serve import WORDS

FAULTS = ("stop_p", "stop_d", "partition", "restart_proxy", "kill_d", "kill_p")
ROLES = ("P", "D", "proxy")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "soak", help="mixed load on 1P1D through the proxy with faults on a schedule: "
        "texts against colocated, resources over time",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default=None,
                   help="a model path, or 'embedded' (default: a tiny random model)")
    p.add_argument("--duration-s", type=float, default=1800.0, help="length of the load")
    p.add_argument("--warmup-s", type=float, default=120.0,
                   help="resources are compared from the first sample after this")
    p.add_argument("--concurrency", type=int, default=3, help="clients in flight")
    p.add_argument("--leave-fraction", type=float, default=0.1,
                   help="share of requests whose client leaves after the first chunk")
    p.add_argument("--fault-every-s", type=float, default=90.0,
                   help="seconds between faults (0: none)")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="the cycle of faults, in order")
    p.add_argument("--stop-s", type=float, default=3.0, help="SIGSTOP to SIGCONT")
    p.add_argument("--partition-s", type=float, default=6.0, help="P's link down this long")
    p.add_argument("--sample-every-s", type=float, default=15.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0,
                   help="a request without a byte for this long is counted hung")
    p.add_argument("--lease-timeout", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--lease-max", type=float, default=60.0, metavar="SECONDS",
                   help="hard lease cap, also how long tombstones are kept")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="P in its own network namespace (root and ip netns): auto uses it "
                   "when available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS")
    p.set_defaults(func=run)


# -- processes --------------------------------------------------------------------------
@dataclass
class Node:
    """One kvrelay process: started (in a namespace, if any), killed, stopped, restarted
    on the same address."""

    name: str
    args: list[str]
    host: str
    log: Path
    ns: str | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    lives: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        from kvrelay.demo import free_port

        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "kvrelay", *self.args, "--host", self.host,
               "--port", str(self.port), "--log-level", "warning"]
        if self.ns is not None:
            cmd = ["ip", "netns", "exec", self.ns, *cmd]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.lives += 1

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"log: {self.log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not healthy within {timeout:.0f} s; log: {self.log}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # its session: a resource tracker too

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


def proc_stats(pid: int | None) -> dict[str, float]:
    """RSS (MiB), open fds and threads of a live process, from /proc."""
    if pid is None:
        return {}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "fds": float(fds),
            "threads": float(fields["Threads"]), **tcp_states(pid)}


# /proc/net/tcp's state codes worth telling apart when fds drift: a socket its peer
# closed that this process never closed (close_wait) is a leak; established ones are
# live requests or pooled keep-alive connections.
TCP_STATES = {"01": "tcp_established", "08": "tcp_close_wait"}


def tcp_states(pid: int) -> dict[str, float]:
    """The process's TCP sockets by state (``TCP_STATES``), from /proc: which of its
    fds are sockets, and what each is doing."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed since listed (listdir's own fd)
                inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[")[:-1])
        rows = [line.split() for name in ("tcp", "tcp6")
                for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]]
    except OSError:
        return {}
    out = dict.fromkeys(TCP_STATES.values(), 0.0)
    for row in rows:
        if len(row) > 9 and row[9] in inodes and row[3] in TCP_STATES:
            out[TCP_STATES[row[3]]] += 1
    return out


@dataclass
class Rig:
    """Where the processes run: one namespace for P and one for the rest, or none."""

    p_host: str = "127.0.0.1"
    rest_host: str = "127.0.0.1"
    p_ns: str | None = None
    rest_ns: str | None = None
    skipped: str | None = None  # why there is no partition

    def partition(self, down: bool) -> None:
        assert self.p_ns is not None
        subprocess.run(["ip", "-n", self.p_ns, "link", "set", "eth0", "down" if down else "up"],
                       check=True, capture_output=True)


@contextlib.contextmanager
def rig(mode: str) -> Iterator[Rig]:
    from kvrelay.bench import netns

    why = netns.unavailable() if mode != "off" else "--netns off"
    if why is not None:
        if mode == "on":
            raise RuntimeError(f"--netns on: {why}")
        yield Rig(skipped=why)
        return
    with netns.veth_pair(f"kvsoak{os.getpid()}") as ((a, addr_a), (b, addr_b)):
        yield Rig(addr_a, addr_b, a, b)


# -- load ---------------------------------------------------------------------------------
@dataclass
class Tally:
    ok: int = 0
    wrong: int = 0
    left: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    wrong_examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.ok + self.wrong + self.left + sum(self.failed.values())


def make_prompts(n: int, rng: random.Random) -> list[str]:
    """``n`` prompts over four shared prefixes (D's and P's prefix caches serve them)."""
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(24)) for _ in range(4)]
    return [f"{prefixes[i % 4]} question {i}: " + " ".join(rng.choice(WORDS) for _ in range(6))
            for i in range(n)]


def request(model: str, prompt: str, chat: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def text_of(answer: dict[str, Any], chat: bool) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] or "") if chat else str(choice["text"])


async def one(client: Any, url: str, body: dict[str, Any], chat: bool, stream: bool,
              leave: bool) -> tuple[str, str | None]:
    """("ok", text) for a whole answer, ("left", None), or ("failed: <cause>", None)."""
    import httpx

    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if not stream:
            r = await client.post(url + path, json=body)
            if r.status_code != 200:
                return f"HTTP {r.status_code}", None
            return "ok", text_of(r.json(), chat)
        parts, done = [], False
        async with client.stream("POST", url + path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return f"HTTP {r.status_code}", None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return "error event", None
                for c in chunk.get("choices") or []:
                    parts.append((c.get("delta") or {}).get("content") or "" if chat
                                 else c.get("text") or "")
                if leave and parts:
                    return "left", None
        return ("ok", "".join(parts)) if done else ("silent: stream cut without [DONE]", None)
    except httpx.TimeoutException:
        return "hung: no byte within the request timeout", None
    except httpx.HTTPError as exc:
        return type(exc).__name__, None


class Load:
    def __init__(self, args: argparse.Namespace, proxy: Node, colo: Node, model: str) -> None:
        self.args, self.proxy, self.colo, self.model = args, proxy, colo, model
        self.rng = random.Random(args.seed)
        self.prompts = make_prompts(24, self.rng)
        self.reference: dict[tuple[bool, int, int], str] = {}
        self.tally = Tally()
        self.tls = ssl.create_default_context()  # once, not per client (it loads the CAs)

    async def expected(self, client: Any, chat: bool, i: int, max_tokens: int) -> str:
        key = (chat, i, max_tokens)
        if key not in self.reference:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = await client.post(self.colo.url + path,
                                  json=request(self.model, self.prompts[i], chat, max_tokens))
            r.raise_for_status()
            self.reference[key] = text_of(r.json(), chat)
        return self.reference[key]

    async def drive(self, until: float) -> None:
        import httpx

        timeout = httpx.Timeout(self.args.request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout) as shared, \
                httpx.AsyncClient(timeout=120.0) as ref:
            async def loop() -> None:
                while time.monotonic() < until:
                    await self.step(shared, ref, timeout)

            await asyncio.gather(*(loop() for _ in range(self.args.concurrency)))

    async def step(self, shared: Any, ref: Any, timeout: Any) -> None:
        import httpx

        rng, t = self.rng, self.tally
        chat, stream = rng.random() < 0.5, rng.random() < 0.6
        i, max_tokens = rng.randrange(len(self.prompts)), rng.choice((1, 4, 8, 16, 24))
        leave = stream and max_tokens > 1 and rng.random() < self.args.leave_fraction
        body = request(self.model, self.prompts[i], chat, max_tokens)
        if leave:  # its own connection: httpcore leaks a slot cancelled while connecting
            async with httpx.AsyncClient(timeout=timeout, verify=self.tls) as own:
                outcome, text = await one(own, self.proxy.url, body, chat, stream, True)
        else:
            outcome, text = await one(shared, self.proxy.url, body, chat, stream, False)
        if outcome == "left":
            t.left += 1
        elif outcome != "ok":
            t.failed[outcome] += 1
            await asyncio.sleep(0.2)  # e.g. the proxy restarting: no busy loop
        elif text == await self.expected(ref, chat, i, max_tokens):
            t.ok += 1
        else:
            t.wrong += 1
            if len(t.wrong_examples) < 5:
                t.wrong_examples.append(f"{'chat' if chat else 'completion'} prompt {i} "
                                        f"max_tokens {max_tokens}: {text!r}")


# -- faults and samples ------------------------------------------------------------------
class Faults(threading.Thread):
    """Strikes the next fault of the cycle every ``--fault-every-s``; a restart waits for
    health. Every exception is recorded, never the run's end."""

    def __init__(self, args: argparse.Namespace, nodes: dict[str, Node], net: Rig,
                 until: float) -> None:
        super().__init__(daemon=True, name="soak-faults")
        self.args, self.nodes, self.net, self.until = args, nodes, net, until
        self.done: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        k, every = 0, self.args.fault_every_s
        while every > 0 and not self.stop_event.wait(every) and time.monotonic() < self.until:
            fault = self.args.faults[k % len(self.args.faults)]
            k += 1
            t0 = time.monotonic()
            try:
                note = self.strike(fault)
            except Exception as exc:  # a fault that failed is reported, the soak goes on
                note = f"failed: {type(exc).__name__}: {exc}"
            self.done.append(f"{fault} ({time.monotonic() - t0:.1f} s){note}")

    def strike(self, fault: str) -> str:
        a, n = self.args, self.nodes
        if fault in ("stop_p", "stop_d"):
            node = n["P" if fault == "stop_p" else "D"]
            node.signal(signal.SIGSTOP)
            time.sleep(a.stop_s)
            node.signal(signal.SIGCONT)
        elif fault == "partition":
            if self.net.skipped is not None:
                return f" skipped: {self.net.skipped}"
            self.net.partition(True)
            try:
                time.sleep(a.partition_s)
            finally:
                self.net.partition(False)
        else:
            node = n[{"restart_proxy": "proxy", "kill_d": "D", "kill_p": "P"}[fault]]
            node.kill()
            node.start()
            node.wait_healthy(a.start_timeout)
        return ""


@dataclass
class Sample:
    t: float
    procs: dict[str, dict[str, float]]  # role -> rss_mib, fds, threads, pid
    gauges: dict[str, float]


def sample_all(nodes: dict[str, Node], t: float) -> Sample:
    procs = {}
    for role in ROLES:
        node = nodes[role]
        procs[role] = {**proc_stats(node.pid), "pid": float(node.pid or 0)}
    gauges: dict[str, float] = {}
    for role, read in (("P", _p_gauges), ("D", _d_gauges), ("proxy", _proxy_gauges)):
        try:
            gauges.update(read(scrape(nodes[role].url)))
        except Exception:  # down (a fault) or busy: a missed reading, not the run's end
            continue
    return Sample(t, procs, gauges)


def _p_gauges(m: dict[str, float]) -> dict[str, float]:
    return {"P leases": held_leases(m), "P tombstones": value(m, "kvrelay_lease_tombstones")}


def _d_gauges(m: dict[str, float]) -> dict[str, float]:
    total, back = blocks(m)
    return {"D loads": value(m, "kvrelay_kv_loads"), "D relay peers":
            value(m, "kvrelay_relay_peers"), "D blocks held": total - back}


def _proxy_gauges(m: dict[str, float]) -> dict[str, float]:
    return {"proxy outstanding": value(m, "kvrelay_proxy_outstanding")}


class Sampler(threading.Thread):
    def __init__(self, nodes: dict[str, Node], every: float, t0: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.nodes, self.every, self.t0 = nodes, every, t0
        self.samples: list[Sample] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.samples.append(sample_all(self.nodes, time.monotonic() - self.t0))
            if self.stop_event.wait(self.every):
                return


# -- the run ------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from kvrelay.errors import UsageError

    if args.duration_s <= 0 or args.concurrency < 1 or args.sample_every_s <= 0:
        raise UsageError("--duration-s and --sample-every-s must be > 0, --concurrency >= 1")
    if not 0.0 <= args.leave_fraction <= 1.0:
        raise UsageError(f"--leave-fraction {args.leave_fraction}: allowed 0 to 1")
    logs = Path(tempfile.mkdtemp(prefix="kvrelay-bench-soak-"))
    with rig(args.netns) as net:
        if net.rest_ns is None:
            return soak(args, net, logs)
        # This process's threads work from the namespace of D, the proxy and the
        # reference (a thread started inside inherits it).
        from kvrelay.bench.netns import entered

        out: list[int] = []

        def inside() -> None:
            assert net.rest_ns is not None
            with entered(net.rest_ns):
                out.append(soak(args, net, logs))

        worker = threading.Thread(target=inside, name="soak")
        worker.start()
        worker.join()
        if not out:
            raise RuntimeError(f"the soak failed; its logs are in {logs}")
        return out[0]


def soak(args: argparse.Namespace, net: Rig, logs: Path) -> int:
    base = [*model_args(args, logs), "--dtype", "float32", "--threads", str(args.threads),
            "--num-blocks", str(args.num_blocks)]
    lease = ["--lease-timeout", str(args.lease_timeout), "--lease-max", str(args.lease_max)]
    from kvrelay.demo import free_port

    nodes = {
        "colo": Node("colo", ["serve", *base], net.rest_host, logs / "colo.log", net.rest_ns),
        "P": Node("P", ["serve", *base, *lease, "--role", "prefill", "--relay-host",
                        net.p_host, "--relay-port", str(free_port())],
                  net.p_host, logs / "prefill.log", net.p_ns),
        "D": Node("D", ["serve", *base, *lease, "--role", "decode"], net.rest_host,
                  logs / "decode.log", net.rest_ns),
    }
    for node in nodes.values():
        node.port = free_port()
    nodes["proxy"] = Node("proxy", ["proxy", "--prefill", nodes["P"].url, "--decode",
                                    nodes["D"].url, "--health-interval", "0.5"],
                          net.rest_host, logs / "proxy.log", net.rest_ns)
    print(f"soak: {args.duration_s:g} s, logs in {logs}; "
          + (f"P in network namespace {net.p_ns} ({net.p_host}), the rest in {net.rest_ns}"
             if net.p_ns else f"one host, no namespaces (partition skipped: {net.skipped})"),
          flush=True)
    try:
        for node in nodes.values():
            node.start()
        for node in nodes.values():
            node.wait_healthy(args.start_timeout)
        return load_and_faults(args, nodes, net)
    finally:
        for node in reversed(list(nodes.values())):
            node.stop()


def load_and_faults(args: argparse.Namespace, nodes: dict[str, Node], net: Rig) -> int:
    from kvrelay.bench.routing import proxy_sees_all_healthy, warm_up

    model = asyncio.run(warm_up([nodes["colo"].url, nodes["P"].url, nodes["D"].url]))
    proxy_sees_all_healthy(nodes["proxy"].url, 2, args.start_timeout)
    t0 = time.monotonic()
    until = t0 + args.duration_s
    load = Load(args, nodes["proxy"], nodes["colo"], model)
    sampler = Sampler(nodes, args.sample_every_s, t0)
    faults = Faults(args, nodes, net, until)
    sampler.start()
    faults.start()
    try:
        asyncio.run(load.drive(until))
    finally:
        faults.stop_event.set()
        faults.join(args.start_timeout + 60)
        if net.p_ns is not None:
            with contextlib.suppress(Exception):
                net.partition(False)
    whole = settle(nodes, 2 * args.lease_timeout + 10)
    sampler.stop_event.set()
    sampler.join(30)
    print(report(args, load.tally, faults.done, sampler.samples, whole))
    silent = sum(n for cause, n in load.tally.failed.items()
                 if cause.startswith(("hung", "silent")))
    return 0 if load.tally.wrong == 0 and silent == 0 and whole else 1


def settle(nodes: dict[str, Node], bound: float) -> bool:
    """Every pool whole and no lease held within ``bound`` seconds of the load's end."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            p, d = scrape(nodes["P"].url), scrape(nodes["D"].url)
            if held_leases(p) == 0 and all(blocks(m)[0] == blocks(m)[1] for m in (p, d)):
                return True
        time.sleep(0.2)
    return False


def report(args: argparse.Namespace, t: Tally, faults: list[str], samples: list[Sample],
           whole: bool) -> str:
    lines = [f"requests: {t.total} ({t.ok} ok, {sum(t.failed.values())} failed, {t.wrong} "
             f"wrong, {t.left} left by their client on purpose)"]
    for cause, n in t.failed.most_common():
        lines.append(f"  failed {n}: {cause}")
    lines += [f"  wrong: {w}" for w in t.wrong_examples]
    lines.append(f"faults ({len(faults)}): " + ", ".join(faults))
    lines.append(f"{'t s':>6} " + " ".join(f"{r + ' rss/fds/thr/pid':>26}" for r in ROLES)
                 + "  gauges")
    for s in samples:
        cells = []
        for role in ROLES:
            p = s.procs.get(role, {})
            cells.append(f"{p.get('rss_mib', 0):7.0f} {p.get('fds', 0):4.0f} "
                         f"{p.get('threads', 0):4.0f} {p.get('pid', 0):8.0f}")
        gauges = " ".join(f"{k}={v:.0f}" for k, v in s.gauges.items())
        lines.append(f"{s.t:6.0f} " + " ".join(f"{c:>26}" for c in cells) + f"  {gauges}")
    lines += flat_summary(args, samples)
    lines.append(f"pools whole and no lease held after the load: {'yes' if whole else 'NO'}")
    silent = sum(n for c, n in t.failed.items() if c.startswith(("hung", "silent")))
    lines.append(f"goal (0 wrong, every failure seen by its client, pools whole): "
                 f"{'held' if t.wrong == 0 and silent == 0 and whole else 'NOT held'}")
    return "\n".join(lines)


def flat_summary(args: argparse.Namespace, samples: list[Sample]) -> list[str]:
    """First vs last sample after warm-up, per role and gauge; per process life too."""
    after = [s for s in samples if s.t >= args.warmup_s]
    if len(after) < 2:
        return [f"resources: fewer than two samples after the {args.warmup_s:g} s warm-up"]
    first, last = after[0], after[-1]
    out = [f"resources, first vs last sample after the {args.warmup_s:g} s warm-up "
           f"(t={first.t:.0f} s vs t={last.t:.0f} s):"]
    for role in ROLES:
        a, b = first.procs.get(role, {}), last.procs.get(role, {})
        same = a.get("pid") == b.get("pid")
        cells = ", ".join(f"{k} {a.get(k, 0):.0f} -> {b.get(k, 0):.0f}"
                          for k in ("rss_mib", "fds", "threads", *TCP_STATES.values()))
        out.append(f"  {role}: {cells}" + ("" if same else
                                           f" (restarted: pid {a.get('pid', 0):.0f} -> "
                                           f"{b.get('pid', 0):.0f})"))
        out.append(f"  {role} longest life after warm-up: " + life_drift(after, role))
    for k in sorted({k for s in after for k in s.gauges}):
        out.append(f"  {k}: {first.gauges.get(k, 0):.0f} -> {last.gauges.get(k, 0):.0f} "
                   f"(most {max(s.gauges.get(k, 0) for s in after):.0f})")
    return out


def life_drift(after: list[Sample], role: str) -> str:
    """The first and last sample of the process life with the most samples, and the
    most of each between (a leak that comes and goes shows there)."""
    lives: dict[float, list[dict[str, float]]] = {}
    for s in after:
        p = s.procs.get(role, {})
        if p.get("pid") and "fds" in p:
            lives.setdefault(p["pid"], []).append(p)
    if not lives:
        return "no samples"
    life = max(lives.values(), key=len)
    a, b = life[0], life[-1]
    return f"{len(life)} samples, " + ", ".join(
        f"{k} {a.get(k, 0):.0f} -> {b.get(k, 0):.0f} (most {max(p.get(k, 0) for p in life):.0f})"
        for k in ("rss_mib", "fds", "threads", *TCP_STATES.values()))

