"""``--kv-cache-dtype fp8`` through real processes: a colocated engine and a 1P1D pair
(shm) behind the proxy, all with an fp8_e4m3 cache under a float32 model, answer with
the same greedy text, the pair's KV moved as fp8 blocks (codes and scales, a whole
number of them); a decode engine in bfloat16 behind an fp8 prefill engine never reads
its KV: the request is refused and P's lease given back."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, ask, colocated_and_pd, metric, metrics, pools_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

FP8 = ("--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvrelay.testing.models import write_tiny_hf_model

    return Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_an_fp8_pair_answers_as_a_colocated_fp8_engine(model_dir: Path, tmp_path: Path) -> None:
    with colocated_and_pd(model_dir, tmp_path, *FP8) as (_c, procs):
        for name in ("colo", "p", "d"):
            assert "KV blocks of 4 tokens (fp8_e4m3)" in procs[name].tail(), name
        colo, proxy = _client(procs["colo"].url), _client(procs["proxy"].url)
        mismatches = []
        for i, prompt in enumerate(("The quick brown fox jumps over the lazy dog again",
                                    "1 2 3 4 5 6 7 8 9 10 11 12", "hello")):
            kw: dict[str, object] = {"model": model_dir.name, "max_tokens": 6 + i,
                                     "temperature": 0.0, "prompt": prompt,
                                     "extra_body": {"ignore_eos": True}}
            want, got = ask(colo, "completion", False, kw), ask(proxy, "completion", True, kw)
            if got != want:
                mismatches.append((prompt, want, got))
        assert not mismatches, "\n".join(map(repr, mismatches))
        # a fresh prompt's pull: whole fp8 blocks, layers x (K, V) x 4 tokens x KV heads x
        # (head_dim codes + a 2-byte scale)
        cfg = json.loads((model_dir / "config.json").read_text())
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        per_block = cfg["num_hidden_layers"] * 2 * 4 * cfg["num_key_value_heads"] * (
            head_dim + 2)
        d = procs["d"]
        before = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total")
        r = proxy.completions.create(model=model_dir.name, prompt="Zebras graze near rivers",
                                     max_tokens=3, temperature=0.0)
        moved = metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total") - before
        assert 0 < moved <= -(-r.usage.prompt_tokens // 4) * per_block, (moved, per_block)
        assert moved % per_block == 0
        pools_free(d, prefill=(procs["p"],), timeout=10)


def test_a_bfloat16_decode_engine_refuses_an_fp8_prefill_engines_kv(
    model_dir: Path, tmp_path: Path
) -> None:
    c = Cluster(model_dir, tmp_path)
    try:
        procs = c.pd(p_extra=FP8, d_extra=("--kv-cache-dtype", "bfloat16"))
        r = httpx.post(procs["proxy"].url + "/v1/completions", timeout=30, json={
            "model": model_dir.name, "prompt": "The quick brown fox", "max_tokens": 4,
            "temperature": 0.0})
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert "does not fit this engine's model" in r.json()["error"]["message"], r.text
        pools_free(procs["d"], prefill=(procs["p"],), timeout=10)
    finally:
        c.close()
        print(c.logs())
