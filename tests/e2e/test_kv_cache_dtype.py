"""``--kv-cache-dtype bfloat16`` and ``fp8`` under a float32 model, through real processes.

A colocated engine and a 1P1D pair (shm) behind the proxy, all with the same cache
dtype: the pair answers as the colocated engine does, its KV moved as blocks of that
dtype (bfloat16: half the bytes of float32 ones; fp8: e4m3 codes and a 2-byte scale per
token and head, a whole number of blocks), and both pools end free. A decode engine
whose cache dtype differs from its prefill engine's never reads that KV: the request is
refused with an error that says why, and P's lease is given back.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, ask, colocated_and_pd, metric, metrics, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

BF16 = ("--kv-cache-dtype", "bfloat16")
FP8 = ("--kv-cache-dtype", "fp8")
# flag, what the engines log, bytes of one head's row of one token (codes and scale)
DTYPES = {"bfloat16": (BF16, "bfloat16", lambda head_dim: head_dim * 2),
          "fp8": (FP8, "fp8_e4m3", lambda head_dim: head_dim + 2)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_cache_dtype_serves_colocated_and_disaggregated_alike(
    model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    flag, logged, row_bytes = DTYPES[dtype]
    with colocated_and_pd(model_dir, tmp_path, *flag) as (_c, procs):
        for name in ("colo", "p", "d"):
            assert f"KV blocks of 4 tokens ({logged})" in procs[name].tail(), name
            assert "dtype float32" in procs[name].tail(), name
        colo, proxy = _client(procs["colo"].url), _client(procs["proxy"].url)
        d = procs["d"]
        mismatches = []
        for i, prompt in enumerate(("The quick brown fox jumps over the lazy dog again",
                                    "1 2 3 4 5 6 7 8 9 10 11 12", "hello")):
            for kind in ("completion", "chat"):
                kw: dict[str, object] = {"model": model_dir.name, "max_tokens": 6 + i,
                                         "temperature": 0.0, "extra_body": {"ignore_eos": True}}
                kw["messages" if kind == "chat" else "prompt"] = (
                    [{"role": "user", "content": prompt}] if kind == "chat" else prompt)
                want, got = ask(colo, kind, False, kw), ask(proxy, kind, True, kw)
                if got != want:
                    mismatches.append((kind, prompt, want, got))
        assert not mismatches, "\n".join(map(repr, mismatches))
        # One fresh prompt's pull: at most its blocks (a float32 block is twice a bfloat16
        # one's bytes), layers x (K, V) x 4 tokens x KV heads x a head's row.
        cfg = json.loads((model_dir / "config.json").read_text())
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        per_block = (cfg["num_hidden_layers"] * 2 * 4 * cfg["num_key_value_heads"]
                     * row_bytes(head_dim))
        before = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total")
        r = proxy.completions.create(model=model_dir.name, prompt="Zebras graze near rivers",
                                     max_tokens=3, temperature=0.0)
        moved = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total") - before
        assert 0 < moved <= -(-r.usage.prompt_tokens // 4) * per_block, (moved, per_block)
        assert moved % per_block == 0
        pools_free(d, prefill=(procs["p"],), timeout=10)


@pytest.mark.parametrize(("p_extra", "d_extra"), [(BF16, ()), (FP8, BF16)],
                         ids=["bfloat16-under-float32", "fp8-under-bfloat16"])
def test_a_decode_engine_with_another_cache_dtype_refuses_the_kv(
    model_dir: Path, tmp_path: Path, p_extra: tuple[str, ...], d_extra: tuple[str, ...]
) -> None:
    c = Cluster(model_dir, tmp_path)
    try:
        procs = c.pd(p_extra=p_extra, d_extra=d_extra)  # () : D keeps the model's float32
        r = httpx.post(procs["proxy"].url + "/v1/completions", timeout=30, json={
            "model": model_dir.name, "prompt": "The quick brown fox", "max_tokens": 4,
            "temperature": 0.0})
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert "does not fit this engine's model" in r.json()["error"]["message"], r.text
        pools_free(procs["d"], prefill=(procs["p"],), timeout=10)
    finally:
        c.close()
        print(c.logs())
