"""vLLM's 8-bit KV cache through KvRelayConnector (`make test-vllm-slow`,
KVRELAY_VLLM_SLOW=1; vLLM-CPU's fp8 cache needs AVX-512 or AMX): P and D with
``--kv-cache-dtype fp8``, whose uint8 blocks the relay moves as they are. Greedy texts
through the proxy equal colocated vLLM's in fp8, every request pulled; the compat
covers the format and the per-layer k/v scales, so a D with a float32 cache is refused
at HELLO naming both dtypes, and prefills itself. docs/vllm.md, 8-bit KV caches."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.pair import (
    FELL_BACK,
    PULLING,
    SLOW_MARKS,
    Pair,
    VllmEngine,
    completion,
    decode_on,
    lease_from,
)


def _avx512_or_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags or " amx_tile" in flags


pytestmark = [
    *SLOW_MARKS,
    pytest.mark.skipif(not _avx512_or_amx(), reason="vLLM-CPU's fp8 KV cache needs x86 "
                       "with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py)"),
]
FP8 = ("--kv-cache-dtype", "fp8")
PROMPT = "Write one sentence about the sea:"
COMPAT = r"kvrelay: worker relay threads on CPUs \S+ \(block layout \S+, compat (\w+)\)"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pair, VllmEngine]]:
    tmp = tmp_path_factory.mktemp("vllm-fp8")
    pr = Pair(tmp, "tcp", "kv_both", args=FP8, d_env={"KVRELAY_FAULT_TRANSFER_DELAY_S": "0"})
    plain = VllmEngine("decode-float32", "kv_consumer", tmp / "d32.log",
                       {"lease_timeout": 30.0}, env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    try:
        pr.start()
        plain.start().wait_healthy()
        yield pr, plain
    finally:
        pr.close()
        plain.kill()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_fp8_pair_pulls_and_answers_as_colocated_fp8(
        engines: tuple[Pair, VllmEngine], stream: bool) -> None:
    pr, _ = engines
    want = completion(pr.p.url, False)
    pulls, fallbacks = pr.d.count(PULLING), pr.d.count(FELL_BACK)
    assert completion(pr.proxy_url, stream) == want
    assert pr.d.count(PULLING) == pulls + 1 and pr.d.count(FELL_BACK) == fallbacks
    p_compat, d_compat, plain_compat = (
        re.findall(COMPAT, e.log.read_text(errors="replace"))[-1]
        for e in (pr.p, pr.d, engines[1]))
    assert p_compat == d_compat != plain_compat  # the format and scales are covered


def test_a_float32_decode_engine_is_refused_naming_both_dtypes(
        engines: tuple[Pair, VllmEngine]) -> None:
    pr, plain = engines
    params = lease_from(pr.p, PROMPT)
    want = completion(plain.url, False, PROMPT)  # D's own prefill, in its own dtype
    assert decode_on(plain, params, PROMPT) == want
    plain.wait_log(r"KV cache dtype mismatch: this prefill engine's KV cache is fp8, the "
                   r"decode engine's is float32", 1, timeout=30)
    # The HELLO was refused: D cannot give the lease back over it; P frees it at its
    # lease timeout.
    pr.p.wait_log(r"ended \((aborted|expired)\)", 1, timeout=60)
