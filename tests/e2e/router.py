"""vllm-router (the Rust router on the package index) as a test process: one
``--vllm-pd-disaggregation`` router in front of engines given by URL (kvrelay's or
vLLM's), its log in a file, killed by the test that started it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvrelay.demo import free_port
from tests.e2e.cluster import poll


def router_binary() -> str | None:
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


ROUTER = router_binary()


@dataclass
class Router:
    """One vllm-router process in P/D mode, its log in ``log``."""

    log: Path
    prefill: list[str]  # engine URLs
    decode: list[str]
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Router:
        assert ROUTER is not None
        cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(self.port),
               "--vllm-pd-disaggregation", "--prometheus-port", str(free_port()),
               "--prefill", *self.prefill,
               *[a for d in self.decode for a in ("--decode", d)],
               "--log-level", "debug", *self.extra]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, **self.env})
        assert poll(self._ready, 60), self.tail()
        return self

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.tail()
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def healthy(self, engine_url: str) -> bool:
        """The router's own view of an engine (its /workers)."""
        workers = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        return bool(next(w["is_healthy"] for w in workers if w["url"] == engine_url))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""
