"""Tool calling through the openai client, on a colocated ``kvrelay serve`` and on 1P1D
behind the proxy (real processes, a tiny random model): a whole tool loop, request with
tools -> the client reads ``tool_calls`` -> a ``tool`` message back -> a final answer.

A tiny random model calls a tool only when made to: ``tool_choice`` ``required`` or a
named function, which the grammar engine enforces. The parameters' schema bounds every
string and number so the call ends within max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Proc, colocated_and_pd
from tests.e2e.tool_schemas import TIME, WEATHER, roomy_tiny_model, valid_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    model = roomy_tiny_model(tmp_path_factory)
    room = ("--num-blocks", "1024")
    auto = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with colocated_and_pd(model, tmp_path_factory.mktemp("tools-logs"), *room,
                          *auto) as (c, out):
        out["auto"] = out["colo"]
        out["plain"] = c.colocated("plain", *room).wait_healthy()  # no auto tool choice
        yield out


def client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=90)


def _calls(c: openai.OpenAI, stream: bool, **kw: Any) -> tuple[Any, list[Any], str | None]:
    """(content, tool calls, finish_reason), streamed or not, as the client reads them."""
    model = c.models.list().data[0].id
    args: dict[str, Any] = dict(model=model, temperature=1.0, seed=3, max_tokens=80, **kw)
    if not stream:
        r = c.chat.completions.create(**args)
        m = r.choices[0].message
        return m.content, list(m.tool_calls or []), r.choices[0].finish_reason
    calls: dict[int, dict[str, Any]] = {}
    content, finish = "", None
    with c.chat.completions.create(stream=True, **args) as s:
        for chunk in s:
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    if tc.id:
                        assert slot["id"] is None, "id sent twice"
                        slot["id"] = tc.id
                        assert tc.type == "function" and tc.function and tc.function.name
                    if tc.function and tc.function.name:
                        slot["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        slot["arguments"] += tc.function.arguments
                finish = ch.finish_reason or finish
    as_objs = [openai.types.chat.ChatCompletionMessageToolCall(
        id=v["id"], type="function", function={"name": v["name"], "arguments": v["arguments"]})
        for _, v in sorted(calls.items())]
    return content or None, as_objs, finish


@pytest.mark.parametrize("where", ["colo", "proxy"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_loop(procs: dict[str, Proc], where: str, stream: bool, choice: str) -> None:
    c = client(procs[where])
    tool_choice: Any = ("required" if choice == "required" else
                        {"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = _calls(c, stream, messages=ASK, tools=TOOLS,
                                    tool_choice=tool_choice, parallel_tool_calls=False)
    assert finish == "tool_calls" and content is None
    assert len(calls) == 1
    call = calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if choice == "named":
        assert call.function.name == "get_weather"
    assert call.function.name in SCHEMAS
    assert valid_args(call.function.name, call.function.arguments), call.function.arguments
    # The loop: the call and its result go back, the model answers in text.
    history: list[Any] = [*ASK, {"role": "assistant", "content": None,
                                 "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21C"}]
    content, calls, finish = _calls(c, stream, messages=history, tools=TOOLS,
                                    tool_choice="none")
    assert calls == [] and finish in ("stop", "length") and content


def test_same_call_colocated_and_1p1d(procs: dict[str, Proc]) -> None:
    """Seeded: the call is the same colocated and through the proxy."""
    out = []
    for where in ("colo", "proxy"):
        _, calls, _ = _calls(client(procs[where]), False, messages=ASK, tools=TOOLS,
                             tool_choice="required")
        out.append([(t.function.name, t.function.arguments) for t in calls])
    assert out[0] == out[1] and out[0]


def _scrub(x: Any) -> Any:
    """An answer or chunk less what two answers never share: ids, created."""
    if isinstance(x, dict):
        return {k: _scrub(v) for k, v in x.items() if k not in ("id", "created")}
    if isinstance(x, list):
        return [_scrub(v) for v in x]
    return x


def _raw(proc: Proc, body: dict[str, Any]) -> Any:
    """The answer's JSON, or a stream's chunks."""
    import httpx

    if not body.get("stream"):
        r = httpx.post(proc.url + "/v1/chat/completions", json=body, timeout=90)
        assert r.status_code == 200, r.text
        return _scrub(r.json())
    chunks = []
    with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=90) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(_scrub(json.loads(line[6:])))
    return chunks


def _by_choice(chunks: list[Any]) -> dict[Any, list[Any]]:
    out: dict[Any, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"] or [None]:
            out.setdefault(None if choice is None else choice["index"], []).append(
                dict(chunk, choices=[choice] if choice else []))
    return out


def _paths(proxy: Proc) -> dict[str, float]:
    from tests.e2e.cluster import metric
    from tests.metrics_util import metrics

    m = metrics(proxy.url)
    return {p: metric(m, f'kvrelay_proxy_requests_total{{path="{p}"}}')
            for p in ("disaggregated", "colocated")}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kw, split", [
    ({"tool_choice": "required"}, True),
    ({"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}, True),
    ({"tool_choice": NAMED}, True),
    ({"tool_choice": "auto", "max_tokens": 12}, True),
    ({"tool_choice": "required", "n": 2}, True),
    # D has no logprobs for token 1 (P computed its logits): served whole by D.
    ({"tool_choice": NAMED, "logprobs": True, "top_logprobs": 2}, False),
    ({"tool_choice": NAMED, "max_tokens": 1}, False),
    # Token 1 is EOS: P's answer ends the leg, D serves it again whole.
    ({"tool_choice": "auto", "logit_bias": {"2": 100}}, False),
    # Cut by max_tokens inside the arguments: still calls, finish length (issue 42).
    ({"tool_choice": "required", "max_tokens": 44}, True),
    ({"tool_choice": NAMED, "max_tokens": 8}, True),
], ids=["required", "required-greedy-single", "named", "auto", "required-n2", "logprobs",
        "one-token", "eos-first", "required-cut", "named-cut"])
def test_tool_answers_split_across_p_and_d_as_colocated(
        procs: dict[str, Proc], stream: bool, kw: dict[str, Any], split: bool) -> None:
    """P samples token 1 under the tools' grammar, D the rest from the pulled KV with its
    grammar fed token 1; the answer (calls, content, finish, usage; streamed: every
    chunk) is the colocated engine's."""
    model = client(procs["colo"]).models.list().data[0].id
    body: dict[str, Any] = {"model": model, "messages": ASK, "tools": TOOLS,
                            "temperature": 1.0, "seed": 3, "max_tokens": 80,
                            "stream": stream, **kw}
    if stream:
        body["stream_options"] = {"include_usage": True}
    before = _paths(procs["proxy"])
    colo = _raw(procs["colo"], body)
    split_answer = _raw(procs["proxy"], body)
    if stream:  # choices interleave as their engines go: each choice's chunks in order
        assert _by_choice(split_answer) == _by_choice(colo)
    else:
        assert split_answer == colo
    after = _paths(procs["proxy"])
    legs = kw.get("n", 1)
    assert after["disaggregated"] - before["disaggregated"] == (legs if split else 0)
    assert after["colocated"] - before["colocated"] == (0 if split else legs)
    if kw["tool_choice"] == "auto":
        return
    # Forced: calls, cut short by max_tokens or not (then the finish is length).
    if stream:
        assert any(c["delta"].get("tool_calls") for chunk in colo for c in chunk["choices"])
        assert not any(c["delta"].get("content") for chunk in colo for c in chunk["choices"])
        return
    assert all(c["message"]["tool_calls"] and c["message"]["content"] is None
               for c in colo["choices"])
    if "max_tokens" in kw:
        assert all(c["finish_reason"] == "length" for c in colo["choices"])


def test_auto_needs_the_flag(procs: dict[str, Proc]) -> None:
    c = client(procs["plain"])
    model = c.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4)
    body: Any = info.value.body
    assert body["param"] == "tool_choice" and "--enable-auto-tool-choice" in body["message"]


def test_auto_with_the_flag_serves_text(procs: dict[str, Proc]) -> None:
    """With --enable-auto-tool-choice a random model's text (no <tool_call>) is content."""
    c = client(procs["auto"])
    model = c.models.list().data[0].id
    r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto",
                                  max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
@pytest.mark.parametrize("where", ["colo", "proxy"])
def test_bad_tools_are_400_naming_the_field(procs: dict[str, Proc], where: str,
                                            kwargs: dict[str, Any], param: str) -> None:
    c = client(procs[where])
    model = c.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body=kwargs)
    body: Any = info.value.body
    assert body["param"] == param, body


def test_tools_and_tool_turns_reach_the_prompt(procs: dict[str, Proc]) -> None:
    """The prompt a tool request is served with is the one /tokenize renders with the
    same tools; the tools' description and the tool turn are in it."""
    import httpx

    c = client(procs["colo"])
    model = c.models.list().data[0].id
    _, (call,), _ = _calls(c, False, messages=ASK, tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False)
    turn = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21C"}
    history: list[Any] = [*ASK, {"role": "assistant", "tool_calls": [call.model_dump()]}, turn]
    r = c.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                  tool_choice="none", max_tokens=2)

    def count(**body: Any) -> int:
        resp = httpx.post(procs["colo"].url + "/tokenize", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["count"])

    served = r.usage.prompt_tokens if r.usage else -1
    assert served == count(messages=history, tools=TOOLS)
    assert count(messages=history) < served  # the tools' description
    assert count(messages=history[:2], tools=TOOLS) < served  # the tool turn
    assert count(messages=[*history[:1], history[2]], tools=TOOLS) < served  # the call
    bad = httpx.post(procs["colo"].url + "/tokenize", timeout=30,
                     json={"messages": ASK, "tools": [{"type": "fn"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].type"
