"""Conditional disaggregation on real processes: 1P1D (shm) behind a proxy started with
``--disaggregation conditional``, and a colocated engine for the expected texts.

A short prompt is prefilled on the decode engine (no lease on P, nothing pulled); a long
cold one goes through P and is pulled; the same long document with a new question is in
D's cache by then and is computed on D. Each answer, streamed and whole, completion and
chat, equals the colocated one; the proxy's ``kvrelay_proxy_route_total{role="prefill"}``
and the engines' own counters say where each prefill ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, ask, pools_free
from tests.metrics_util import metrics, sample

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MAX_LOCAL = 32  # tokens, at the proxy's 4 characters a token
SHORT = "The quick brown fox"
DOC = ("A long shared document that the decode engine will have cached once it served it: "
       "it spans many KV blocks of four tokens, so a prefill of it is worth a transfer, "
       "and its second question differs only in a short tail at the end of it. ")


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("logs"))
    try:
        procs = {"colo": c.colocated(), "p": c.prefill(), "d": c.decode("decode", "shm")}
        for p in procs.values():
            p.wait_healthy()
        procs["proxy"] = c._proc("proxy", [
            "proxy", "--prefill", procs["p"].url, "--decode", procs["d"].url,
            "--health-interval", "0.5", "--disaggregation", "conditional",
            "--local-prefill-max-tokens", str(MAX_LOCAL),
            "--local-prefill-queue-tokens", "0"]).start().wait_healthy()
        yield procs
    finally:
        c.close()
        print(c.logs())


def client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="none", max_retries=0, timeout=60)


def kwargs(model: str, kind: str, prompt: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": model, "max_tokens": 6, "temperature": 0.0,
                          "extra_body": {"ignore_eos": True}}
    if kind == "chat":
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    return kw


class Counts:
    """Where prefills ran: the proxy's prefill placements by reason, P's handed-over
    requests, D's pulled bytes, as deltas since the last call."""

    def __init__(self, procs: dict[str, Proc]) -> None:
        self.procs = procs
        self.last = self._now()

    def _now(self) -> dict[str, float]:
        proxy = metrics(self.procs["proxy"].url)
        out = {r: sample(proxy, "kvrelay_proxy_route_total", role="prefill", reason=r)
               for r in ("local_short_prompt", "local_cached", "least_outstanding")}
        out["handed_over"] = sample(metrics(self.procs["p"].url),
                                    "kvrelay_requests_finished_total", reason="remote_decode")
        out["pulled"] = sample(metrics(self.procs["d"].url), "kvrelay_kv_transfer_bytes_total")
        return out

    def delta(self) -> dict[str, float]:
        pools_free(self.procs["d"], prefill=(self.procs["p"],))
        now = self._now()
        out = {k: now[k] - self.last[k] for k in now}
        self.last = now
        return out


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_short_local_long_disaggregated_cached_local_texts_equal_colocated(
        dep: dict[str, Proc], kind: str, stream: bool) -> None:
    model = next(iter(client(dep["colo"]).models.list())).id
    tag = f"{kind} {'streamed' if stream else 'whole'}"  # each case its own document
    counts = Counts(dep)

    def check(prompt: str) -> None:
        kw = kwargs(model, kind, prompt)
        assert ask(client(dep["proxy"]), kind, stream, kw) == \
            ask(client(dep["colo"]), kind, stream, kw)

    check(f"{SHORT} ({tag})")
    d = counts.delta()
    assert d["local_short_prompt"] == 1 and d["handed_over"] == 0 and d["pulled"] == 0, d

    long_prompt = f"{tag}: {DOC * 2}"
    assert len(long_prompt) > 8 * MAX_LOCAL
    check(long_prompt + "Question one: what is it?")
    d = counts.delta()
    assert d["least_outstanding"] == 1 and d["handed_over"] == 1 and d["pulled"] > 0, d

    check(long_prompt + "Question two: why?")
    d = counts.delta()
    assert d["local_cached"] == 1 and d["handed_over"] == 0 and d["pulled"] == 0, d
