"""2P2D on one host: two prefill and two decode engines (one shm, one tcp) behind one
proxy, 200 requests at concurrency 16 with AsyncOpenAI. Zero failed requests, every
answer has its 8 tokens, greedy answers equal a colocated engine's, both engines of
each role took work, and all four pools are entirely free at the end with no lease held.
Then KV-aware routing: requests sharing a long prefix land on one P and one D.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvrelay.bench.serve import WORDS
from tests.e2e.cluster import Cluster, Proc, metric, metrics, pools_free, sample

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(150)]

N, CONCURRENCY, MAX_TOKENS = 200, 16, 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Proc]]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("disagg-2p2d-logs"))
    try:
        ps = [c.prefill("prefill-a"), c.prefill("prefill-b")]
        ds = [c.decode("decode-shm", "shm"), c.decode("decode-tcp", "tcp")]
        colo = c.colocated()
        for x in (*ps, *ds, colo):
            x.wait_healthy()
        proxy = c.proxy(ps, ds).wait_healthy()
        yield {"p": ps, "d": ds, "colo": [colo], "proxy": [proxy], "model": [model],  # type: ignore[list-item]
               "cluster": [c]}
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


async def run_all(url: str, model: str, n: int) -> list[tuple[int, str, int, str]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> tuple[int, str, int, str]:
        async with sem:
            kw = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                  "extra_body": {"ignore_eos": True}}
            prompt = f"Request number {i % 50} asks for a few tokens"
            if i % 2:
                r = await client.chat.completions.create(
                    messages=[{"role": "user", "content": prompt}], **kw)
                return i, r.choices[0].message.content or "", r.usage.completion_tokens, \
                    r.choices[0].finish_reason
            r2 = await client.completions.create(prompt=prompt, **kw)
            return i, r2.choices[0].text, r2.usage.completion_tokens, r2.choices[0].finish_reason

    try:
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    finally:
        await client.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} failed requests, e.g. {failed[:3]!r}"
    return [r for r in results if not isinstance(r, BaseException)]


def test_2p2d_200_requests_concurrency_16(cluster: dict[str, list]) -> None:
    model = cluster["model"][0].name
    got = asyncio.run(run_all(cluster["proxy"][0].url, model, N))
    assert len(got) == N
    assert all(tokens == MAX_TOKENS and finish == "length" for _, _, tokens, finish in got), got
    # 100 distinct requests (50 prompts x completion/chat): greedy answers equal colocated.
    want = {i: text for i, text, _, _ in asyncio.run(run_all(cluster["colo"][0].url, model, 100))}
    assert [(i, t) for i, t, _, _ in got if t != want[i % 100]] == []
    for d in cluster["d"]:
        assert metric(metrics(d.url), "kvrelay_kv_transfer_bytes_total") > 0, d.name
    for p in cluster["p"]:
        assert sample(metrics(p.url), "kvrelay_requests_finished_total", reason="remote_decode") \
            > 0, p.name
    pools_free(*cluster["d"], prefill=tuple(cluster["p"]), timeout=10)


def test_kv_aware_routing_keeps_a_shared_prefix_on_one_p_and_one_d(
    cluster: dict[str, list]
) -> None:
    """Two long prefixes, three requests each, interleaved and one at a time, through a
    fresh proxy (empty records): each prefix stays on one P and one D, the two prefixes
    on different engines, and each engine's own prefix cache hits the whole shared
    prefix on the second and third request. Least-outstanding routing sends all six to the first
    engine of each role (a tie every time), so none of this holds without it."""
    from tokenizers import Tokenizer

    ps, ds, model = cluster["p"], cluster["d"], cluster["model"][0]
    proxy = cluster["cluster"][0].proxy(ps, ds, name="proxy-kv-aware").wait_healthy()
    rng = random.Random(13)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(90)) for _ in range(2)]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    before = {e.name: metrics(e.url) for e in (*ps, *ds)}
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    kw = {"model": model.name, "max_tokens": 2, "temperature": 0.0,
          "extra_body": {"ignore_eos": True}}
    for i in range(3):
        for j, prefix in enumerate(prefixes):
            prompt = f"{prefix}. Question {i} of {j}: what next?"
            r = client.completions.create(prompt=prompt, **kw)
            assert r.usage.completion_tokens == 2
    pools_free(*ds, prefill=tuple(ps), timeout=10)

    def delta(e: Proc, name: str, **labels: str) -> float:
        return sample(metrics(e.url), name, **labels) - sample(before[e.name], name, **labels)

    assert [delta(p, "kvrelay_requests_finished_total", reason="remote_decode")
            for p in ps] == [3, 3]
    assert [delta(d, "kvrelay_requests_finished_total", reason="length") for d in ds] == [3, 3]
    # Which prefix went where: the first engine of each role took the first prefix (it
    # was routed first, all idle and empty), the second the other. Requests 2 and 3 of
    # each hit its whole shared prefix, in full blocks of 4 tokens (a token at the
    # boundary may merge with the tail): on P, and on D, which pulls only the rest.
    for p, d, prefix in zip(ps, ds, prefixes, strict=True):
        shared = (len(tok.encode(prefix).ids) - 1) // 4 * 4
        assert delta(p, "kvrelay_prefix_cache_hits_total") >= 2 * shared, p.name
        assert delta(d, "kvrelay_prefix_cache_hits_total") >= 2 * shared, d.name
    route = metrics(proxy.url)
    for role in ("prefill", "decode"):
        assert sample(route, "kvrelay_proxy_route_total", role=role,
                      reason="prefix_match") == 4, role
        assert sample(route, "kvrelay_proxy_route_total", role=role,
                      reason="least_outstanding") == 2, role
