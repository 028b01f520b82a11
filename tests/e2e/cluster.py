"""Real kvrelay processes on localhost for the disaggregated e2e tests.

``Proc`` is one subprocess (an engine or the proxy) with its log file; ``Cluster``
starts a set of them, waits for /health and kills every one in ``close`` (also
after failures). Helpers read Prometheus metrics and wait until the KV pools are
entirely free and no lease is held.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvrelay.demo import free_port
from tests.metrics_util import blocks_released, metrics, sample

REPO = Path(__file__).resolve().parents[2]
# float32 pinned (the default, auto, is bfloat16 on a CPU with native bf16): these tests
# compare answers token for token across engines, caches and schedules.
BLOCK_ARGS = ("--num-blocks", "256", "--block-size", "4", "--dtype", "float32")


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""),
            **(extra or {})}


def wait_healthy(p: Any, timeout: float, every: float) -> None:
    """Poll ``p.url``/health until 200; a process that exits first, or a timeout, raises
    with the tail of its log. ``p``: a Proc, or tests/vllm's VllmEngine."""
    assert p.proc is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n" + p.tail())
        try:
            if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(every)
    raise TimeoutError(f"{p.name} not healthy within {timeout} s:\n" + p.tail())


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # any of 127.0.0.0/8: engines of one DNS name share a port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Proc:
        cmd = [sys.executable, "-m", "kvrelay", *self.args, "--host", self.host,
               "--port", str(self.port), "--log-level", "info"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env(self.extra_env), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> Proc:
        wait_healthy(self, timeout, every=0.1)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Cluster:
    """Engines and proxies; every process started through it is killed in close()."""

    def __init__(self, model: Path, logdir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.model = model
        self.logdir = logdir
        self.extra_env = extra_env or {}
        self.procs: list[Proc] = []

    def _proc(self, name: str, args: list[str], **where: Any) -> Proc:
        """``where``: the Proc's host and port, when not 127.0.0.1 and a free port."""
        p = Proc(name, args, self.logdir / f"{name}-{len(self.procs)}.log",
                 extra_env=self.extra_env, **where)
        self.procs.append(p)
        return p

    def colocated(self, name: str = "colo", *extra: str) -> Proc:
        return self._proc(name, ["serve", str(self.model), *BLOCK_ARGS, *extra]).start()

    def prefill(self, name: str = "prefill", *extra: str, **where: Any) -> Proc:
        return self._proc(name, [
            "serve", str(self.model), "--role", "prefill", "--relay-port", str(free_port()),
            "--kv-transport", "auto", "--lease-timeout", "2", *BLOCK_ARGS, *extra],
            **where).start()

    def decode(self, name: str = "decode", transport: str = "shm", *extra: str,
               **where: Any) -> Proc:
        return self._proc(name, [
            "serve", str(self.model), "--role", "decode", "--kv-transport", transport,
            "--lease-timeout", "2", *BLOCK_ARGS, *extra], **where).start()

    def proxy(self, prefill: list[Proc], decode: list[Proc], name: str = "proxy") -> Proc:
        return self._proc(name, [
            "proxy", "--prefill", *[p.url for p in prefill], "--decode",
            *[d.url for d in decode], "--health-interval", "0.5"]).start()

    def pd(self, p_extra: tuple[str, ...] = (), d_extra: tuple[str, ...] = ()) -> dict[str, Proc]:
        """1P1D, D over shm ("p", "d", started with their extra flags), and a proxy in
        front of the pair ("proxy"), all healthy."""
        procs = {"p": self.prefill("prefill", *p_extra),
                 "d": self.decode("decode", "shm", *d_extra)}
        for p in procs.values():
            p.wait_healthy()
        procs["proxy"] = self.proxy([procs["p"]], [procs["d"]]).wait_healthy()
        return procs

    def restart(self, old: Proc) -> Proc:
        """A fresh process with the same arguments and port (the proxy keeps its URL)."""
        old.kill()
        new = Proc(old.name, old.args, old.log, port=old.port, extra_env=old.extra_env,
                   host=old.host)
        self.procs.append(new)
        return new.start().wait_healthy()

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill()

    def logs(self) -> str:
        return "\n".join(f"==== {p.name} ====\n{p.tail()}" for p in self.procs)


@contextlib.contextmanager
def colocated_and_pd(model: Path, logdir: Path,
                     *extra: str) -> Iterator[tuple[Cluster, dict[str, Proc]]]:
    """A colocated engine ("colo"), 1P1D over shm ("p", "d"), each started with ``extra``,
    and a proxy in front of the pair ("proxy"), all healthy; closed at the end, with the
    logs printed (pytest shows them when a test failed)."""
    c = Cluster(model, logdir)
    try:
        colo = c.colocated("colo", *extra)
        procs = {"colo": colo, **c.pd(extra, extra)}
        colo.wait_healthy()
        yield c, procs
    finally:
        c.close()
        print(c.logs())


def poll(cond: Callable[[], bool], timeout: float) -> bool:
    """Whether ``cond()`` came true within ``timeout`` seconds (asked every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def metric(m: dict[str, float], query: str) -> float:
    """Sum of the samples of ``query`` (a name, or a name with some labels such as
    'x_total{reason="done"}': samples may carry others, model_name for one)."""
    name, _, labels = query.partition("{")
    pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    return sample(m, name, **pairs)


def held_leases(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items()
               if k.startswith("kvrelay_leases{") and ('"held"' in k or '"pulling"' in k))


def pools_free(*engines: Proc, prefill: tuple[Proc, ...] = (), timeout: float = 10.0) -> None:
    """Wait until no block of any engine is held (each free or cached) and no prefill
    lease is held."""
    deadline = time.monotonic() + timeout
    while True:
        bad = {}
        for e in (*engines, *prefill):
            m = metrics(e.url)
            free, total = blocks_released(m)
            if free != total:
                bad[e.name] = (free, total)
        for p in prefill:
            h = held_leases(metrics(p.url))
            if h:
                bad[p.name + " leases"] = h
        if not bad:
            return
        assert time.monotonic() < deadline, f"pools not free after {timeout} s: {bad}"
        time.sleep(0.1)


def write_fat_model(dir: Path) -> Path:
    """The tiny model's tokenizer with more layers and KV heads: ~64 KiB of KV per block of
    4 tokens, so that a long prompt's transfer takes long enough to be interrupted."""
    import json

    from kvrelay.testing.models import (
        tiny_hf_config,
        tiny_tokenizer_json,
        tiny_weights,
        write_hf_dir,
    )

    tok = tiny_tokenizer_json()
    cfg = tiny_hf_config("llama", len(json.loads(tok)["model"]["vocab"]))
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=4, head_dim=64,
               max_position_embeddings=1024)
    return write_hf_dir(Path(dir), cfg, tiny_weights(cfg, 0), tok)


def ask(c: Any, kind: str, stream: bool, kw: dict[str, Any]) -> tuple[str, int, str]:
    """One completion or chat request through the openai client ``c``, streamed or not:
    (text, completion tokens from usage, finish reason)."""
    if kind == "chat":
        if not stream:
            r = c.chat.completions.create(**kw)
            return r.choices[0].message.content or "", r.usage.completion_tokens, \
                r.choices[0].finish_reason
        text, usage, finish = "", -1, ""
        for ch in c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}):
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
            for choice in ch.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, usage, finish
    if not stream:
        r = c.completions.create(**kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
    text, usage, finish = "", -1, ""
    for ch in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for choice in ch.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, usage, finish
