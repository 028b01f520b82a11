"""An HTTP fuzz over every route of every kvrelay process: never a 5xx (issue 21).

Real processes on localhost, the tiny model: ``serve`` in each role (both, prefill,
decode) and the proxy in front of a prefill and a decode engine. A seeded generator
(same seed, same requests) sends each route malformed and deeply nested JSON, every
field with values of the wrong type, huge strings and numbers, random extra keys,
forged kv_transfer_params, and every method. Whatever the input, the answer is a 2xx
or a 4xx (a 400 with an OpenAI-style error body), never a 5xx.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SEED = 21
ENGINE_ROUTES = ["/health", "/version", "/metrics", "/v1/models", "/v1/completions",
                 "/v1/chat/completions", "/v1/kv/release"]
PROXY_ROUTES = ["/health", "/metrics", "/v1/models", "/v1/completions",
                "/v1/chat/completions"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
DEEP = 100_000

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                     "n", "seed", "stop", "stop_token_ids", "ignore_eos",
                     "include_stop_str_in_output", "stream", "stream_options",
                     "kv_transfer_params", "logit_bias", "response_format",
                     "presence_penalty", "frequency_penalty", "user", "logprobs", "echo",
                     "suffix"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "logprobs", "echo",
                                                        "suffix")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"]
LEASE_FIELDS = ["lease_id", "relay", "engine_id", "block_ids", "num_tokens", "first_token",
                "compat", "first_token_sent", "do_remote_decode", "do_remote_prefill"]

RAW_BODIES = [
    b"", b"{", b"}", b"not json", b"\xff\xfe\xfd", b"null", b"[]", b"1", b'"text"',
    b"NaN", b'{"model": NaN}', b'{"model": -Infinity}', b"1e999999",
    b"[" * DEEP + b"]" * DEEP, b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    b'{"model": "\\ud800"}', b'{"prompt": "' + b"x" * (2 << 20) + b'"}',
    b'{"max_tokens": ' + b"9" * 5000 + b"}",  # more digits than int() takes
    b'{"kv_transfer_params": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b'{"kv_transfer_params": {"engine_id": "e", "lease_id": ' + b"[" * DEEP + b"]" * DEEP
    + b"}}",
]


def weird_values(rng: random.Random) -> list[Any]:
    return [None, True, False, 0, -1, 2**63, -(2**63), 10**30, 1e308, -0.0, 0.5, "", "x",
            "x" * (1 << 20), "\u0000", "NaN", "-1", "5", [], {}, [None], [1] * 1000,
            [[1, 2], [3]], [""], {"a": "b"}, {"type": "json_schema"},
            {"role": "user"}, [{"role": "user", "content": ["x", 1]}],
            random_json(rng, 4), random_json(rng, 4), random_json(rng, 4)]


def random_json(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth > 0 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 1, 7, 2**31, 2**64, -(2**40)])
    if kind == 2:
        return rng.choice([0.0, -1.5, 1e-300, 3.25, 1e300])
    if kind == 3:
        return rng.choice(["", "a", "user", "assistant", "127.0.0.1:1", "x" * 300, "é\u2028"])
    if kind == 4:
        return rng.choice(["model", "text", "json_object", "[]", "{}"])
    if kind == 5:
        return [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    keys = COMPLETION_FIELDS + LEASE_FIELDS + ["role", "content", "type", "x"]
    return {rng.choice(keys): random_json(rng, depth - 1) for _ in range(rng.randrange(4))}


def base_body(route: str, model: str) -> dict[str, Any]:
    if route == "/v1/completions":
        return {"model": model, "prompt": "fuzz me", "max_tokens": 2}
    if route == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "fuzz me"}],
                "max_tokens": 2}
    return {"kv_transfer_params": {"engine_id": "e", "lease_id": "l"}}


def bodies(route: str, model: str, rng: random.Random) -> Iterator[bytes]:
    """The fuzzed bodies for one POST route (a bounded, seeded sample)."""
    yield from RAW_BODIES
    base = base_body(route, model)
    fields = {"/v1/completions": COMPLETION_FIELDS,
              "/v1/chat/completions": CHAT_FIELDS}.get(route, ["kv_transfer_params"])
    values = weird_values(rng)
    for field in fields:  # every field, several wrong values each
        for value in rng.sample(values, 4):
            if field == "max_tokens" and value is None:
                value = 0  # unset: a run to the end of the context, slow and not fuzz
            yield json.dumps({**base, field: value}).encode()
    for _ in range(10):  # random extra keys
        extra = {rng.choice([*fields, "x", "stream"]): rng.choice(values) for _ in range(3)}
        yield json.dumps({**base, **extra}).encode()
    for _ in range(15):  # forged lease fields, of every type
        params = {f: rng.choice([*values, "127.0.0.1:1"]) for f in rng.sample(
            LEASE_FIELDS, rng.randrange(1, len(LEASE_FIELDS)))}
        yield json.dumps({**base, "kv_transfer_params": params}).encode()
    well_typed = {"lease_id": "0" * 32, "relay": "127.0.0.1:1", "engine_id": "e",
                  "block_ids": [0], "num_tokens": 3, "first_token": 1, "compat": "c"}
    yield json.dumps({**base, "kv_transfer_params": well_typed}).encode()


def send(client: httpx.Client, method: str, url: str, body: bytes | None) -> tuple[int, str]:
    try:
        r = client.request(method, url, content=body,
                           headers={"content-type": "application/json"} if body else {})
    except httpx.HTTPError as e:  # a crash or a reset is as bad as a 5xx
        return 599, repr(e)
    return r.status_code, r.text[:300]


def fuzz(proc: Proc, routes: list[str], model: str) -> list[tuple[str, str, int, str]]:
    """Every request for ``proc``; the ones answered with a 5xx (or a 400 without an
    OpenAI-style error body)."""
    rng = random.Random(f"{SEED}-{proc.name}")
    jobs: list[tuple[str, str, bytes | None]] = []
    for route in [*routes, "/nope", "/v1/nope"]:
        jobs += [(m, route, None) for m in METHODS]
    for route in routes:
        if route.startswith("/v1/") and route != "/v1/models":
            jobs += [("POST", route, b) for b in bodies(route, model, rng)]
    bad = []
    # No keep-alive: a request on a connection the server just closed for idleness
    # would be reset, which says nothing about the server.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=proc.url, timeout=60, limits=no_reuse) as client, \
            ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda j: send(client, *j), jobs))
    for (method, route, body), (status, text) in zip(jobs, answers, strict=True):
        ok = status < 500 and (status != 400 or '"error"' in text)
        if not ok:
            bad.append((method, route, status, f"{(body or b'')[:120]!r} -> {text}"))
    assert len(jobs) > 300  # the fuzz did run: every route, every kind of input
    return bad


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kvrelay.testing.models import write_tiny_hf_model

    model = Path(write_tiny_hf_model(tmp_path_factory.mktemp("tiny-model")))
    c = Cluster(model, tmp_path_factory.mktemp("fuzz-logs"))
    try:
        both, p, d = c.colocated("both"), c.prefill("prefill"), c.decode("decode", "tcp")
        for x in (both, p, d):
            x.wait_healthy()
        proxy = c.proxy([p], [d]).wait_healthy()
        yield {"model": model.name, "both": both, "prefill": p, "decode": d, "proxy": proxy}
    finally:
        c.close()
        print(c.logs())  # shown by pytest when a test failed


@pytest.mark.parametrize("role", ["both", "prefill", "decode", "proxy"])
def test_no_input_makes_any_route_answer_5xx(procs: dict[str, Any], role: str) -> None:
    """Bug (issue 21): POST /v1/kv/release with deeply nested JSON answered 500 (it
    called json.loads itself, not protocol.load_json)."""
    routes = PROXY_ROUTES if role == "proxy" else ENGINE_ROUTES
    bad = fuzz(procs[role], routes, procs["model"])
    assert not bad, "\n".join(map(str, bad[:20]))
    r = httpx.get(procs[role].url + "/health", timeout=5)
    assert r.status_code == 200, "the fuzz left the process unhealthy"
